"""K = 0 equals the synchronous path: a few steps of the run with `max_off_policy_steps = 0`.

Synchronous RL trains at step n only tokens sampled by version n. The check runs `rl` for `steps` steps
with K = 0 (a child process, `launcher/child_run.py`) and reads its metrics: every step's trained groups
have staleness 0 (`rollout/data_staleness/max`), no trained token was sampled by an older version
(`offpolicy/effective_steps/max`), and the importance ratio stays at the engine/trainer mismatch
(`mismatch_kl` within the doctor's limit at every step).
"""

from __future__ import annotations

from pathlib import Path

from prime_async.doctor.checks import MISMATCH_KL_LIMIT, CheckResult
from prime_async.launcher.child_run import run_rl, without_flags
from prime_async.utils.monitor import read_jsonl

NAME = "K = 0 equals sync"
K_FLAGS = ("--orchestrator.max_off_policy_steps", "--orchestrator.max-off-policy-steps")


def k0_check(orchestrator: list[dict], trainer: list[dict], steps: int) -> CheckResult:
    """The check on the metrics of a K = 0 run of `steps` steps."""
    if len(trainer) < steps or len(orchestrator) < steps:
        return CheckResult(NAME, False, f"the run logged {len(trainer)} of {steps} trainer steps",
                           "see the run's logs")  # fmt: skip
    stale = [m["step"] for m in orchestrator if m.get("rollout/data_staleness/max", 0) > 0]
    offpolicy = [m["step"] for m in trainer if m.get("offpolicy/effective_steps/max", 0) > 0]
    worst_kl = max(m.get("mismatch_kl", 0.0) for m in trainer)
    if stale or offpolicy:
        return CheckResult(
            NAME, False, f"steps {sorted(set(stale + offpolicy))} trained tokens of an older version",
            "a bug of the scheduler or of the engine's per-token versions (weight_version): report it",
        )  # fmt: skip
    if worst_kl > MISMATCH_KL_LIMIT:
        return CheckResult(
            NAME, False, f"every token on-policy, but mismatch_kl reached {worst_kl:.2e}",
            "the engine and trainer disagree on-policy: see the logprob check's fix",
        )  # fmt: skip
    return CheckResult(
        NAME, True, f"{steps} steps: staleness 0, every trained token of the step's version, "
        f"mismatch_kl <= {worst_kl:.1e}",
    )  # fmt: skip


def run_k0(rl_argv: list[str], run_dir: Path, *, steps: int, timeout_s: float) -> CheckResult:
    args = [*without_flags(rl_argv, K_FLAGS), "--orchestrator.max_off_policy_steps", "0"]
    run_rl(args, steps=steps, run_dir=run_dir, timeout_s=timeout_s, caller="doctor")
    metrics = run_dir / "metrics"
    return k0_check(read_jsonl(metrics / "orchestrator.jsonl"), read_jsonl(metrics / "trainer.jsonl"), steps)
