"""The doctor's checks: pure functions over probe episodes (and the model calls each one made).

Each returns a `CheckResult`: passed (True), failed (False) or skipped (None), one line of detail with
the figures, and for a failure the fix. Nothing here starts a process or loads a model (`probe.py`,
`logprobs.py` and `sync_run.py` collect what they read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from prime_async.rollouts.gateway import GatewayCall
from prime_async.rollouts.types import Episode

MISMATCH_KL_LIMIT = 1e-3  # k3 KL(engine || trainer) per token at version 0; fp32 CPU runs measure ~1e-7


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool | None  # None = skipped (detail says why)
    detail: str
    fix: str = ""

    @property
    def status(self) -> str:
        return {True: "pass", False: "FAIL", None: "skip"}[self.passed]


@dataclass
class Probe:
    """One episode run of one example: its trained episodes (one per seat) and every model call it made."""

    example_id: int
    episodes: list[Episode]
    calls: list[GatewayCall] = field(default_factory=list)
    seed: int | None = None

    @property
    def ok(self) -> list[Episode]:
        return [e for e in self.episodes if e.status == "ok"]


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _drift(call: GatewayCall, episodes: list[Episode]) -> int | None:
    """None when the call's prompt + output is (up to truncation) a prefix of one trained sequence; else
    the token position where the closest trained sequence departs from what the engine saw."""
    seen = [*call.prompt_ids, *call.output_ids]
    best = -1
    for ep in episodes:
        n = min(len(seen), len(ep.token_ids))
        at = _first_difference(seen[:n], ep.token_ids[:n])
        if at == n:
            return None
        best = max(best, at)
    return best


def token_round_trip(probes: list[Probe]) -> CheckResult:
    """Every turn's tokens (prompt as sent, output as sampled) are exactly the trained tokens: no
    retokenization drift between turns, nothing split into extra branches, every sampled node matched."""
    turns = problems = 0
    first = ""
    for probe in probes:
        if not probe.ok:
            continue
        for turn, call in enumerate(probe.calls):
            turns += 1
            if (at := _drift(call, probe.ok)) is not None:
                problems += 1
                first = (
                    first or f"example {probe.example_id} turn {turn}: trained tokens differ at position {at}"
                )
        for ep in probe.ok:
            branches = int(ep.metrics.get("num_branches", 1))
            unmatched = int(ep.metrics.get("unmatched_version_nodes", 0))
            if branches > 1 or unmatched:
                problems += 1
                first = first or (
                    f"example {probe.example_id}: {branches} branches, {unmatched} sampled turns not "
                    "found in the engine's outputs"
                )
    if not turns:
        return CheckResult("tokens round-trip", None, "no ok episode to check")
    share = trained_share([ep for probe in probes for ep in probe.ok])
    if problems:
        return CheckResult(
            "tokens round-trip", False, f"{problems} drifts in {turns} turns ({share}); first: {first}",
            "keep orchestrator.env.renderer's token_exact on (each turn extends the previous turn's tokens "
            "as sampled); a split left means the env rewrote its history (env/branch_splits/<cause>)",
        )  # fmt: skip
    return CheckResult(
        "tokens round-trip", True, f"{turns} turns of {len(probes)} episodes match exactly ({share})"
    )


def trained_share(episodes: list[Episode]) -> str:
    """'a of b sampled turns, c of d sampled tokens trained as sampled' over `episodes` (their trained
    branch's sampled turns and loss tokens against every turn and token their seat sampled)."""
    turns = sum(int(ep.metrics.get("sampled_turns", 0)) for ep in episodes)
    trained = sum(int(ep.metrics.get("trained_turns", 0)) for ep in episodes)
    tokens = sum(int(ep.metrics.get("sampled_tokens", 0)) for ep in episodes)
    loss = sum(sum(ep.loss_mask) for ep in episodes)
    return f"{trained} of {turns} sampled turns, {loss} of {tokens} sampled tokens trained as sampled"


def same_seed_same_reward(pairs: list[tuple[Probe, Probe]]) -> CheckResult:
    """Two runs of one example with one sampling seed: equal tokens must give equal rewards."""
    compared = differing_tokens = 0
    for a, b in pairs:
        for ea, eb in zip(a.ok, b.ok, strict=False):
            if ea.token_ids != eb.token_ids:
                differing_tokens += 1
                continue
            compared += 1
            if ea.reward != eb.reward:
                return CheckResult(
                    "same seed, same reward", False,
                    f"example {a.example_id}: the same tokens got reward {ea.reward} then {eb.reward}",
                    "make the reward a function of the task and the episode only (seed any randomness "
                    "from the task, no clock, no network state)",
                )  # fmt: skip
    if not compared:
        why = "the engine sampled different tokens for one seed" if differing_tokens else "no ok episode pair"
        return CheckResult("same seed, same reward", None, why)
    return CheckResult(
        "same seed, same reward", True, f"{compared} seeded repeats gave equal tokens and reward"
    )


def prompt_fits(probes: list[Probe], *, seq_len: int, max_tokens: int | None) -> CheckResult:
    """The first turn: the longest first prompt (as rendered, tool schemas and system prompt included)
    leaves room for `max_tokens` within `seq_len`; no episode was refused as too long."""
    refused = [
        p.example_id for p in probes for e in p.episodes if e.metrics.get("env_error") == "prompt_too_long"
    ]
    lengths = [(len(p.calls[0].prompt_ids), p.example_id) for p in probes if p.calls]
    if refused:
        return CheckResult(
            "longest prompt fits seq_len", False, f"examples {sorted(set(refused))} were refused: prompt > "
            f"seq_len {seq_len}", "raise seq_len or shorten the prompts / tool schemas",
        )  # fmt: skip
    if not lengths:
        return CheckResult("longest prompt fits seq_len", None, "no model call was made")
    longest, example = max(lengths)
    room = seq_len - longest
    detail = (
        f"longest prompt {longest} tokens (example {example}), seq_len {seq_len}, max_tokens {max_tokens}"
    )
    if max_tokens is not None and room < max_tokens:
        return CheckResult(
            "longest prompt fits seq_len", False, detail + f": {room} tokens left for the reply",
            f"raise seq_len to >= {longest + max_tokens} or lower sampling.max_tokens to {max(room, 0)}",
        )  # fmt: skip
    return CheckResult("longest prompt fits seq_len", True, detail)


def _episode_length(probe: Probe) -> int:
    """The longest sequence one turn of the probe's episode needed: a call's prompt + reply as the engine
    saw it, or a prompt refused as too long (that call never reached the engine)."""
    sent = [len(c.prompt_ids) + len(c.output_ids) for c in probe.calls]
    refused = [int(e.metrics.get("overflow_prompt_tokens", 0)) for e in probe.episodes]
    return max([*sent, *refused], default=0)


def episode_fits(probes: list[Probe], *, seq_len: int, max_tokens: int | None) -> CheckResult:
    """Whole episodes, every turn: no probe episode outgrew `seq_len` (`Episode.overlong`: a later turn's
    prompt refused, or a reply clamped at seq_len); the longest episode against seq_len. Skipped when only
    first turns outgrew it: `prompt_fits` checks the first turn (prompt + max_tokens) and names the fix."""
    name = "longest episode fits seq_len"
    if not probes:
        return CheckResult(name, None, "no episode was run")
    longest = max(probes, key=_episode_length)
    turns = max((int(e.metrics.get("num_turns", 0)) for e in longest.episodes), default=0)
    detail = (
        f"longest episode {_episode_length(longest)} tokens (example {longest.example_id}, {turns} turns)"
    )
    over = [(p, e) for p in probes for e in p.episodes if e.overlong]
    later = [(p, e) for p, e in over if e.metrics.get("overflow_turn") != 1]
    if over and not later:  # only first turns: `prompt_fits` is that check and names the fix
        return CheckResult(
            name, None, f"only first turns outgrew seq_len ({len(over)}): see the prompt check"
        )
    if not over:
        return CheckResult(name, True, f"{detail}, seq_len {seq_len}")
    over = later
    probe, ep = over[0]
    turn, prompt = ep.metrics.get("overflow_turn"), ep.metrics.get("overflow_prompt_tokens")
    where = f"turn {turn}'s prompt is {prompt} tokens" if turn else f"it reached {len(ep.token_ids)} tokens"
    need = f" to >= {int(prompt) + max_tokens}" if turn and max_tokens is not None else ""
    return CheckResult(
        name, False, f"{len(over)} of {sum(len(p.episodes) for p in probes)} episodes outgrew seq_len "
        f"{seq_len}; first: example {probe.example_id}: {where}; {detail}",
        f"raise seq_len{need} (every turn's prompt holds the whole conversation so far, plus its reply), "
        "lower sampling.max_tokens or end episodes sooner; meanwhile orchestrator.batch.sink.overlong "
        "decides (truncate: trained up to the turn that did not fit; drop)",
    )  # fmt: skip


def mismatch_kl(kl: float | None, tokens: int, *, limit: float = MISMATCH_KL_LIMIT) -> CheckResult:
    """Engine vs trainer logprobs of the sampled tokens at version 0 (k3 KL per token)."""
    if kl is None or not tokens:
        return CheckResult("engine vs trainer logprobs (v0)", None, "no sampled token to score")
    detail = f"mismatch KL {kl:.2e} per token over {tokens} tokens (limit {limit:.0e})"
    if kl > limit:
        return CheckResult(
            "engine vs trainer logprobs (v0)", False, detail,
            "run engine and trainer in the same dtype (model.dtype), the same attention and RoPE settings; "
            "for MoE models set router_replay = true",
        )  # fmt: skip
    return CheckResult("engine vs trainer logprobs (v0)", True, detail)
