"""K = 0 equals the synchronous path: a few steps of the run with `max_off_policy_steps = 0`.

Synchronous RL trains at step n only tokens sampled by version n. The check runs `rl` for `steps` steps
with K = 0 (a child process, `launcher/child_run.py`) and reads its metrics:

- staleness: every step's trained groups have staleness 0 (`rollout/data_staleness/max`), and the sink
  dropped no group as stale (`rollout/buffer/dropped_stale`). The sink's sweep drops anything older than
  K before it is trained, so the first figure alone cannot fail; a stale drop is what a K = 0 run that
  generated off its schedule leaves behind.
- per token: with S = `optim.num_steps_per_batch`, the j-th mini-batch of batch n trains tokens of
  version n after j optimizer steps, so `offpolicy/effective_steps/max` is S - 1 by design (`optim/num_steps`
  - 1 of the row, the mini-batches actually stepped); a token of version n - 1 would be at least S steps
  off. Loss tokens without an engine version (`offpolicy/unknown_version_tokens`) take the batch's
  dispatch version as a stand-in, so their distance proves nothing: they are reported, not passed.
- mismatch: `mismatch_kl/on_policy`, the KL over the tokens trained by the very weights that sampled them
  (distance 0, version known), within the doctor's limit. The whole-batch `mismatch_kl` includes the
  later mini-batches' tokens, trained after the first update: that is learning, not a mismatch. Rows of
  an older trainer without the on-policy figure fall back to `mismatch_kl` when S = 1.
"""

from __future__ import annotations

from pathlib import Path

from prime_async.doctor.checks import MISMATCH_KL_LIMIT, CheckResult
from prime_async.launcher.child_run import run_rl, without_flags
from prime_async.utils.monitor import read_jsonl

NAME = "K = 0 equals sync"
K_FLAGS = ("--orchestrator.max_off_policy_steps", "--orchestrator.max-off-policy-steps")
BUG_FIX = "a bug of the scheduler or of the engine's per-token versions (weight_version): report it"


def allowed_distance(row: dict) -> int:
    """Largest per-token distance a K = 0 trainer row may log: its mini-batches stepped, minus one."""
    return max(int(row.get("optim/num_steps", 1)), 1) - 1


def _on_policy_kl(trainer: list[dict]) -> tuple[float, int]:
    """(worst on-policy mismatch KL over the rows, on-policy tokens it was measured on)."""
    worst, tokens = 0.0, 0
    for m in trainer:
        if "mismatch_kl/on_policy" in m:
            n = int(m.get("offpolicy/on_policy_tokens", 0))
            if n > 0:
                worst, tokens = max(worst, m["mismatch_kl/on_policy"]), tokens + n
        elif allowed_distance(m) == 0 and "mismatch_kl" in m:  # an older trainer's row, S = 1
            worst, tokens = max(worst, m["mismatch_kl"]), tokens + 1
    return worst, tokens


def _failures(orchestrator: list[dict], trainer: list[dict]) -> list[tuple[str, str]]:
    """(detail, fix) of every part that failed, the scheduler's first."""
    out: list[tuple[str, str]] = []
    stale = sorted(m["step"] for m in orchestrator if m.get("rollout/data_staleness/max", 0) > 0)
    if stale:
        out.append((f"steps {stale} trained groups dispatched at an older version (staleness > 0)", BUG_FIX))
    over = [m for m in trainer if m.get("offpolicy/effective_steps/max", 0) > allowed_distance(m)]
    if over:
        out.append((
            f"steps {[m['step'] for m in over]} trained tokens of an older version (per-token distance "
            f"{max(m['offpolicy/effective_steps/max'] for m in over):.0f} optimizer steps; at most "
            f"{allowed_distance(over[0])} by design, the batch's later mini-batches)",
            BUG_FIX,
        ))  # fmt: skip
    dropped = {m["step"]: m["rollout/buffer/dropped_stale"] for m in orchestrator
               if m.get("rollout/buffer/dropped_stale", 0) > 0}  # fmt: skip
    if dropped:
        out.append((
            f"{sum(dropped.values()):.0f} groups dropped as stale (steps {sorted(dropped)}): generation ran "
            "ahead of the served version, which a synchronous run never does",
            "admission dispatched groups that could not ship at K = 0 (max_buffered_groups above "
            "batch_groups does that); otherwise " + BUG_FIX,
        ))  # fmt: skip
    unknown = sum(m.get("offpolicy/unknown_version_tokens", 0) for m in trainer)
    if unknown > 0:
        out.append((
            f"{unknown:.0f} trained tokens carry no engine version, so their staleness cannot be checked",
            "their turns' tokens did not match the engine's outputs (see the tokens round-trip check)",
        ))  # fmt: skip
    return out


def k0_check(orchestrator: list[dict], trainer: list[dict], steps: int) -> CheckResult:
    """The check on the metrics of a K = 0 run of `steps` steps (module docstring)."""
    if len(trainer) < steps or len(orchestrator) < steps:
        return CheckResult(NAME, False, f"the run logged {len(trainer)} of {steps} trainer steps",
                           "see the run's logs")  # fmt: skip
    if failures := _failures(orchestrator, trainer):
        return CheckResult(NAME, False, "; ".join(d for d, _ in failures), "; ".join(f for _, f in failures))
    worst_kl, tokens = _on_policy_kl(trainer)
    if worst_kl > MISMATCH_KL_LIMIT:
        return CheckResult(
            NAME, False, f"every token on-policy, but mismatch_kl on the tokens trained by the weights that "
            f"sampled them reached {worst_kl:.2e}",
            "the engine and trainer disagree on-policy: see the logprob check's fix",
        )  # fmt: skip
    if tokens == 0:
        return CheckResult(NAME, False, "no trained token at distance 0: the mismatch cannot be judged",
                           "see the run's trainer metrics (offpolicy/*)")  # fmt: skip
    distance = max(allowed_distance(m) for m in trainer)
    return CheckResult(
        NAME, True, f"{steps} steps: staleness 0, every trained token of the step's version (per-token "
        f"distance <= {distance}: num_steps_per_batch - 1), on-policy mismatch_kl <= {worst_kl:.1e}",
    )  # fmt: skip


def run_k0(rl_argv: list[str], run_dir: Path, *, steps: int, timeout_s: float) -> CheckResult:
    args = [*without_flags(rl_argv, K_FLAGS), "--orchestrator.max_off_policy_steps", "0"]
    run_rl(args, steps=steps, run_dir=run_dir, timeout_s=timeout_s, caller="doctor")
    metrics = run_dir / "metrics"
    return k0_check(read_jsonl(metrics / "orchestrator.jsonl"), read_jsonl(metrics / "trainer.jsonl"), steps)
