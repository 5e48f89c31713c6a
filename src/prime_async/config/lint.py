"""The configuration lint: combinations that train, but add off-policy drift or waste, as warnings.

A refusal (a combination whose semantics cannot hold) belongs to `interactions.py` or the orchestrator's
validators; a rule here only warns, and never for a combination those already refuse. Who calls it:
`doctor` (lines under its report), `--dry-run` of `rl`, `orchestrator` and `trainer` (WARNING lines on
stderr after the TOML) and the start of `rl` and `orchestrator` (`entrypoints/commands.py`: logged, never
stopping). Each rule reads one component's keys, so it runs on that standalone config too; `lint_rl` runs
both components' rules. Rules and examples: docs/async-knobs.md, "Configuration lint".

Invariants:
- every rule is a pure function of a validated config; nothing here imports torch or starts anything;
- a finding is one line: its stable id (`lint/<name>`), what the combination costs, and the fix;
- every shipped config under `configs/` is quiet (`tests/config/test_lint.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: the orchestrator command never loads the trainer's or rl's schema
    from prime_async.config.orchestrator import OrchestratorConfig
    from prime_async.config.rl import RLConfig
    from prime_async.config.trainer import TrainerConfig

MAX_TOKENS_SHARE = 0.75  # warn when one turn's max_tokens leaves less than a quarter of seq_len to the prompt


@dataclass(frozen=True)
class Finding:
    """One warning: `id` is stable (tests and docs name it), `cost` and `fix` are one clause each."""

    id: str
    cost: str
    fix: str

    def line(self) -> str:
        return f"{self.id}: {self.cost}; fix: {self.fix}"


def multi_step_offpolicy(cfg: TrainerConfig) -> Finding | None:
    """Several optimizer steps per batch at K > 0: the batch's last mini-batch trains tokens up to
    (K + 1) * S - 1 optimizer steps old instead of K (the trust-region warning of `config/trainer.py`
    fires only when that outruns the loss's band; this one on any extra drift). K unknown (None): quiet."""
    from prime_async.config.trainer import max_effective_steps

    k, steps = cfg.max_off_policy_steps, cfg.optim.num_steps_per_batch
    if not k or steps <= 1:
        return None
    distance = max_effective_steps(k, steps)
    return Finding(
        "lint/multi-step-offpolicy",
        f"optim.num_steps_per_batch = {steps} at max_off_policy_steps = {k} trains tokens up to {distance} "
        f"optimizer steps off-policy instead of {k} (each extra step per batch adds drift on top of K)",
        "set optim.num_steps_per_batch = 1 (a larger batch instead), or lower max_off_policy_steps",
    )


def buffer_deeper_than_k(cfg: OrchestratorConfig) -> Finding | None:
    """`admission.max_buffered_groups` above (K + 1) * batch_groups: admission's landing rule never lets
    more than K + 1 batches of groups live, so the slots beyond never fill (no drift; a cap that does not
    bind, and memory planned for groups that never exist). Deterministic runs use a fixed schedule: quiet."""
    k, buffered, ship = cfg.max_off_policy_steps, cfg.resolved_max_buffered_groups, cfg.batch_groups
    if cfg.deterministic or buffered <= (k + 1) * ship:
        return None
    return Finding(
        "lint/buffer-deeper-than-k",
        f"admission.max_buffered_groups = {buffered} > (max_off_policy_steps + 1) * batch_groups = "
        f"{(k + 1) * ship}: admission never holds more than K + 1 batches (a group is admitted only if its "
        f"batch ships within K), so {buffered - (k + 1) * ship} slots never fill",
        f"unset admission.max_buffered_groups (default {(k + 1) * ship}) or raise max_off_policy_steps",
    )


def update_interval_lag(cfg: OrchestratorConfig) -> Finding | None:
    """`weights.update_interval` = I > 1 with a small K: engines serve a version up to I - 1 behind the
    trainer, so a group starts I - 1 versions stale; warn when that is at least half of K (I > K + 1 is
    already refused by `check_admission`)."""
    interval, k = cfg.weights.update_interval, cfg.max_off_policy_steps
    lag = interval - 1
    if lag < 1 or 2 * lag < k:
        return None
    return Finding(
        "lint/update-interval-lag",
        f"weights.update_interval = {interval} with max_off_policy_steps = {k}: engines lag the trainer by "
        f"up to {lag} version(s), {lag} of the {k} versions of staleness budget spent before a group starts "
        "(admission waits more, groups train staler)",
        "set weights.update_interval = 1, or raise max_off_policy_steps",
    )


def _max_tokens(cfg: OrchestratorConfig) -> list[tuple[str, int]]:
    """Each training env's key and its max_tokens per turn (its override, else orchestrator.sampling's)."""
    default = ("orchestrator.sampling.max_tokens", cfg.sampling.max_tokens)
    return [
        (f"orchestrator.envs[{env.label}].sampling.max_tokens", env.sampling.max_tokens)
        if env.sampling.max_tokens is not None
        else default
        for env in cfg.envs
    ]


def max_tokens_near_seq_len(cfg: OrchestratorConfig) -> Finding | None:
    """A turn's max_tokens above MAX_TOKENS_SHARE of seq_len: prompt + completion must fit seq_len (the
    gateway clamps the reply there), so any prompt longer than the margin cuts a full-length completion:
    overlong episodes, truncated or dropped by `sink.overlong`. The first such env is named."""
    near = [(key, n) for key, n in _max_tokens(cfg) if n > MAX_TOKENS_SHARE * cfg.seq_len]
    if not near:
        return None
    key, tokens = near[0]
    margin = cfg.seq_len - tokens
    return Finding(
        "lint/max-tokens-near-seq-len",
        f"{key} = {tokens} with seq_len = {cfg.seq_len} leaves {max(margin, 0)} tokens for the prompt (and "
        "earlier turns): longer prompts clamp the reply, so long completions end overlong (truncated or "
        f"dropped per batch.sink.overlong = {cfg.batch.sink.overlong!r})",
        f"raise seq_len to at least max_tokens + the longest prompt, or lower max_tokens (<= "
        f"{int(MAX_TOKENS_SHARE * cfg.seq_len)} keeps a quarter of seq_len for the prompt)",
    )


def group_size_one(cfg: OrchestratorConfig) -> Finding | None:
    """group_size = 1 without a teacher: the advantage is reward minus the group's mean, always 0, so no
    sample carries a gradient (on-policy distillation's teacher term still does: quiet with a teacher)."""
    if cfg.group_size > 1 or cfg.teacher is not None:
        return None
    cost = (
        "group_size = 1: the group-relative advantage (reward - group mean) is always 0: no learning signal"
    )
    if cfg.batch.sink.reject_equal_reward:
        cost += ", and batch.sink.reject_equal_reward drops every group"
    return Finding("lint/group-size-one", cost, "set group_size >= 2 (4-16 is usual)")


def drain_offpolicy(cfg: OrchestratorConfig) -> Finding | None:
    """`weights.pause_mode = "drain"` at K > 0: every update holds admission until no episode is in
    flight, so generation stops for the slowest episode's tail at each update, the overlap K > 0 buys.
    Deterministic runs always drain (their pause_mode is ignored) and K = 0 has nothing in flight: quiet."""
    k = cfg.max_off_policy_steps
    if cfg.weights.pause_mode != "drain" or k == 0 or cfg.deterministic:
        return None
    return Finding(
        "lint/drain-offpolicy",
        f'weights.pause_mode = "drain" with max_off_policy_steps = {k}: every weight update stops admission '
        "until the slowest in-flight episode finishes, so engines idle at each update and the overlap that "
        "K > 0 pays for in staleness is lost",
        'set weights.pause_mode = "retract" (the default) or "in_place", or max_off_policy_steps = 0',
    )


ORCHESTRATOR_RULES = (
    buffer_deeper_than_k,
    update_interval_lag,
    max_tokens_near_seq_len,
    group_size_one,
    drain_offpolicy,
)
TRAINER_RULES = (multi_step_offpolicy,)


def lint_orchestrator(cfg: OrchestratorConfig) -> list[Finding]:
    return [f for rule in ORCHESTRATOR_RULES if (f := rule(cfg)) is not None]


def lint_trainer(cfg: TrainerConfig) -> list[Finding]:
    return [f for rule in TRAINER_RULES if (f := rule(cfg)) is not None]


def lint_rl(cfg: RLConfig) -> list[Finding]:
    """Both components' rules over an `rl` config (`rl` copies K into trainer.max_off_policy_steps)."""
    return [*lint_orchestrator(cfg.orchestrator), *lint_trainer(cfg.trainer)]
