"""Per-request sampling params and the batched sampler of the embedded engine.

Invariant: the logprob reported for a token is `log_softmax(logits / temperature)[token]`, i.e. the
distribution before top-k/top-p/min-p truncation (as SGLang reports it); temperature 0 means greedy and
reports `log_softmax(logits)`. A request with `sampling_seed` draws from its own generator, so its tokens
do not depend on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# tokens per block of the two-level draw (`_draw_blocked`); vocabularies not divisible by it use `_draw`
DRAW_BLOCK = 256


@dataclass(frozen=True)
class SamplingParams:
    """The SGLang `sampling_params` subset the engine honours (validated by the server)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def truncates(self) -> bool:
        return self.top_k > 1 or self.top_p < 1.0 or self.min_p > 0.0


def _truncate(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero out tokens outside top-k / top-p / min-p for each row (rows: (N, V)); not renormalized."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    v = probs.shape[-1]
    ranks = torch.arange(v, device=probs.device)[None]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else v for p in params], device=probs.device)[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=probs.device, dtype=probs.dtype)[:, None]
    min_p = torch.tensor([p.min_p for p in params], device=probs.device, dtype=probs.dtype)[:, None]
    # keep a token while the mass strictly before it is < top_p (the top token is always kept)
    drop = (ranks >= top_k) | ((sorted_p.cumsum(-1) - sorted_p) >= top_p)
    drop |= sorted_p < min_p * sorted_p[:, :1]
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row (probs (N, V) unnormalized, u (N,) uniform in [0, 1)).

    torch.multinomial on CPU spends ~1.8 ms per (8, 1024) call in exponential_; this is far cheaper.
    """
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return idx.clamp_(max=probs.shape[-1] - 1)


def _below(total: torch.Tensor) -> torch.Tensor:
    """The largest float under each element of `total` (> 0): a draw target strictly inside the mass."""
    return torch.nextafter(total, torch.zeros_like(total))


def _draw_blocked(weights: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-level inverse-CDF draw per row: weights (N, V) unnormalized with V % DRAW_BLOCK == 0, u (N,)
    uniform in [0, 1) -> (token ids (N,), total mass (N,)).

    The block is picked by the cumulative mass of blocks of DRAW_BLOCK tokens, then the token inside it by
    the target's remaining fraction of that block's mass: the same distribution as `_draw`, without a
    cumulative sum over the whole vocabulary (the slowest pass on CPU). A token of zero weight is never
    drawn: every target lies strictly below the mass it is searched in.
    """
    n, v = weights.shape
    blocks = weights.view(n, v // DRAW_BLOCK, DRAW_BLOCK)
    mass = blocks.sum(-1)  # (N, V / DRAW_BLOCK)
    cum = mass.cumsum(-1)
    total = cum[:, -1]
    target = torch.minimum(u * total, _below(total))
    block = torch.searchsorted(cum, target[:, None], right=True)[:, 0]
    rows = torch.arange(n, device=weights.device)
    own = mass[rows, block]  # > 0: cum strictly increases at `block`
    frac = ((target - (cum[rows, block] - own)) / own).clamp_(0.0, 1.0)
    inner = blocks[rows, block].cumsum(-1)  # (N, DRAW_BLOCK)
    inner_target = torch.minimum(frac * inner[:, -1], _below(inner[:, -1]))
    pos = torch.searchsorted(inner, inner_target[:, None], right=True)[:, 0]
    return block * DRAW_BLOCK + pos, total


def _scaled_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits / temperature per row (temperature 0, greedy, counts as 1)."""
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    if all(t == temps[0] for t in temps):
        return logits / temps[0] if temps[0] != 1.0 else logits
    return logits / torch.tensor(temps, device=logits.device, dtype=logits.dtype)[:, None]


def _sample_plain(z: torch.Tensor, generator: torch.Generator) -> tuple[list[int], list[float]]:
    """Plain temperature sampling of every row (the common RL case), z = scaled logits (B, V): no
    full-vocabulary log-softmax; a token's logprob is `z[token] - max(z) - log(sum(exp(z - max(z))))`
    (log-softmax's own formula) with the sum the draw has already made."""
    top = z.amax(-1, keepdim=True)
    weights = (z - top).exp_()
    u = torch.rand(z.shape[0], generator=generator, device=z.device)
    if z.shape[-1] % DRAW_BLOCK == 0:
        tokens, total = _draw_blocked(weights, u)
    else:
        tokens, total = _draw(weights, u), weights.sum(-1)
    logprobs = z.gather(-1, tokens[:, None])[:, 0] - top[:, 0] - total.log()
    return tokens.tolist(), logprobs.tolist()


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> tuple[list[int], list[float]]:
    """logits (B, V) float32 -> sampled token ids and their logprobs (lists of length B)."""
    b = logits.shape[0]
    z = _scaled_logits(logits, params)
    if all(not p.greedy and not p.truncates for p in params) and all(g is None for g in generators):
        return _sample_plain(z, default_generator)
    logp_bv = torch.log_softmax(z, dim=-1)
    tokens = torch.empty(b, dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        tokens[greedy] = logp_bv[greedy].argmax(-1)
    stochastic = [i for i, p in enumerate(params) if not p.greedy]
    if stochastic:
        probs = logp_bv[stochastic].exp()
        trunc = [j for j, i in enumerate(stochastic) if params[i].truncates]
        if trunc:
            probs[trunc] = _truncate(probs[trunc], [params[stochastic[j]] for j in trunc])
        shared = [j for j, i in enumerate(stochastic) if generators[i] is None]
        if shared:
            u = torch.rand(len(shared), generator=default_generator, device=probs.device)
            tokens[[stochastic[j] for j in shared]] = _draw(probs[shared], u)
        for j, i in enumerate(stochastic):
            gen = generators[i]
            if gen is not None:
                tokens[i] = _draw(probs[j : j + 1], torch.rand(1, generator=gen, device=probs.device))[0]
    logprobs = logp_bv[torch.arange(b, device=logits.device), tokens]
    return tokens.tolist(), logprobs.tolist()
