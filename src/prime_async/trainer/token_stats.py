"""Per-batch statistics of the loss tokens, shared by both backends: `TokenStats`.

Built per micro-batch on the CPU (`TokenStats.of`), merged over micro-batches and mini-batches (`merge`),
then over data-parallel ranks (`all_reduce`); `metrics()` gives the trainer's `mismatch_kl`, `ratio/*`,
`masked_fraction`, `entropy`, `offpolicy/effective_steps/{mean,max}`, and the two figures that say how
much of that is checkable: `mismatch_kl/on_policy` over `offpolicy/on_policy_tokens` (the loss tokens of a
known version trained at distance 0, i.e. by the very weights that sampled them: there the ratio is the
engine/trainer mismatch alone, whatever K and `num_steps_per_batch` are) and
`offpolicy/unknown_version_tokens` (loss tokens without an engine version: their distance is a stand-in).

Invariants: every field is a sum, a min or a max, so merging is associative and independent of how the
batch was split; the ratio fields use rho_t = exp(logp - sampler_logp) as the loss sees it; on-policy
tokens are a subset of the loss tokens and exclude every token of unknown version.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def reduce_device() -> torch.device:
    """Device for collectives of small CPU-side values: NCCL only reduces CUDA tensors."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class TokenStats:
    """Additive per-batch statistics of the loss tokens (merged over micro-batches and ranks): the ratio,
    masking, entropy, and the effective off-policy distance in optimizer steps (`offpolicy.py`)."""

    num_tokens: torch.Tensor
    num_masked: torch.Tensor
    ratio_sum: torch.Tensor
    ratio_sq_sum: torch.Tensor
    ratio_min: torch.Tensor
    ratio_max: torch.Tensor
    kl_sum: torch.Tensor
    entropy_sum: torch.Tensor
    steps_sum: torch.Tensor
    steps_max: torch.Tensor
    on_policy_tokens: torch.Tensor  # loss tokens of a known version at distance 0
    on_policy_kl_sum: torch.Tensor
    unknown_tokens: torch.Tensor  # loss tokens whose version is unknown (-1)

    @staticmethod
    def empty() -> TokenStats:
        z = torch.zeros((), dtype=torch.float64)
        inf = torch.tensor(float("inf"), dtype=torch.float64)
        return TokenStats(z, z, z, z, inf, -inf, z, z, z, -inf, z, z, z)

    @staticmethod
    def of(
        logp, sampler_logp, loss_mask, masked, entropy, effective_steps=None, unknown_version=None
    ) -> TokenStats:
        """`effective_steps` (T,): off-policy distance of each token (None = 0, i.e. on-policy);
        `unknown_version` (T,) bool: the token's version is unknown (None = every version known)."""
        with torch.no_grad():  # statistics live on the CPU (a few scalars per micro-batch)
            log_ratio = (logp - sampler_logp)[loss_mask].double().cpu()
            rho = torch.exp(log_ratio)
            stats = TokenStats.empty()
            if rho.numel() == 0:
                return stats
            mask = loss_mask.cpu()
            steps = torch.zeros_like(rho)
            if effective_steps is not None:
                steps = torch.as_tensor(effective_steps)[mask].double()
            unknown = torch.zeros_like(rho, dtype=torch.bool)
            if unknown_version is not None:
                unknown = torch.as_tensor(unknown_version, dtype=torch.bool)[mask]
            kl = rho - 1 - log_ratio  # k3 estimator of KL(mu || pi_theta) on tokens sampled from mu (>= 0)
            on_policy = (steps == 0) & ~unknown
            return TokenStats(
                num_tokens=torch.tensor(float(rho.numel()), dtype=torch.float64),
                num_masked=masked[loss_mask].sum().double().cpu(),
                ratio_sum=rho.sum(),
                ratio_sq_sum=rho.pow(2).sum(),
                ratio_min=rho.min(),
                ratio_max=rho.max(),
                kl_sum=kl.sum(),
                entropy_sum=entropy[loss_mask].double().sum().cpu(),
                steps_sum=steps.sum(),
                steps_max=steps.max(),
                on_policy_tokens=on_policy.sum().double(),
                on_policy_kl_sum=kl[on_policy].sum(),
                unknown_tokens=unknown.sum().double(),
            )

    def merge(self, other: TokenStats) -> TokenStats:
        return TokenStats(
            self.num_tokens + other.num_tokens,
            self.num_masked + other.num_masked,
            self.ratio_sum + other.ratio_sum,
            self.ratio_sq_sum + other.ratio_sq_sum,
            torch.minimum(self.ratio_min, other.ratio_min),
            torch.maximum(self.ratio_max, other.ratio_max),
            self.kl_sum + other.kl_sum,
            self.entropy_sum + other.entropy_sum,
            self.steps_sum + other.steps_sum,
            torch.maximum(self.steps_max, other.steps_max),
            self.on_policy_tokens + other.on_policy_tokens,
            self.on_policy_kl_sum + other.on_policy_kl_sum,
            self.unknown_tokens + other.unknown_tokens,
        )

    def all_reduce(self) -> TokenStats:
        """Merge across data-parallel ranks (no-op without a process group)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self
        device = reduce_device()
        sums = torch.stack(
            [
                self.num_tokens,
                self.num_masked,
                self.ratio_sum,
                self.ratio_sq_sum,
                self.kl_sum,
                self.entropy_sum,
                self.steps_sum,
                self.on_policy_tokens,
                self.on_policy_kl_sum,
                self.unknown_tokens,
            ]
        ).to(device)
        # max(-min) and max in one collective: MIN is MAX of the negation
        maxes = torch.stack([-self.ratio_min, self.ratio_max, self.steps_max]).to(device)
        dist.all_reduce(sums)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        sums, maxes = sums.cpu(), maxes.cpu()
        return TokenStats(
            sums[0], sums[1], sums[2], sums[3], -maxes[0], maxes[1], sums[4], sums[5], sums[6], maxes[2],
            sums[7], sums[8], sums[9],
        )  # fmt: skip

    def metrics(self) -> dict[str, float]:
        n = max(float(self.num_tokens), 1.0)
        mean = float(self.ratio_sum) / n
        var = max(float(self.ratio_sq_sum) / n - mean**2, 0.0)
        seen = self.num_tokens > 0
        return {
            "mismatch_kl": float(self.kl_sum) / n,
            "ratio/mean": mean,
            "ratio/std": var**0.5,
            "ratio/min": float(self.ratio_min) if seen else 0.0,
            "ratio/max": float(self.ratio_max) if seen else 0.0,
            "masked_fraction": float(self.num_masked) / n,
            "entropy": float(self.entropy_sum) / n,
            "offpolicy/effective_steps/mean": float(self.steps_sum) / n,
            "offpolicy/effective_steps/max": float(self.steps_max) if seen else 0.0,
            "mismatch_kl/on_policy": float(self.on_policy_kl_sum) / max(float(self.on_policy_tokens), 1.0),
            "offpolicy/on_policy_tokens": float(self.on_policy_tokens),
            "offpolicy/unknown_version_tokens": float(self.unknown_tokens),
        }
