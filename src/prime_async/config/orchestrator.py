"""Config schema of the `orchestrator` command (`uv run orchestrator @ orchestrator.toml`).

Sections: the run-wide keys `rl` shares (model, seq_len, max_steps, output_dir, ...), the batch knobs
(`batch_groups`, `group_size`, `max_off_policy_steps` = K), and one section per concern: `envs`,
`sampling`, `inference` (the engines, and what they must serve: run id, LoRA adapters, routed experts),
`admission` (groups issued and held), `batch` (finished groups into the trainer's batch: `sink`,
`advantage`, `packing`), `data` (the prompt order and its checkpoints: `seed`, `shuffle`, `ckpt`),
`weights`, `eval`, `teacher`. At most 20 keys per class. A key that moved into a section is refused with
one line naming its new key (`MOVED_KEYS`).

Invariants checked at validation time, each by the small validator next to the section it checks (each
error names the TOML key and the fix):
- `check_admission`: `admission.max_buffered_groups >= batch_groups`; `weights.update_interval <=
  max_off_policy_steps + 1` (otherwise admission could wait for a version never loaded: a deadlock); a
  buffer deeper than K + 1 batches only warns (`lint.py`, lint/buffer-deeper-than-k);
- `check_envs`: the training environments are the list `envs` (the loader rewrites the one-table
  shorthand `[env]` to `envs = [env]`, `shorthands`), names unique; no trained `top_p < 1`;
- `OrchestratorEvalConfig`: unique `eval.envs` names; `eval.placement = "shared"` takes no
  `eval.base_urls`, `dedicated` and `external` need them;
- `check_weights`: eval while training needs the filesystem transport; `shared` needs loopback hosts;
- `check_deterministic`: `weights.update_interval = 1`, no `batch.sink.import_path`, one env, no retry.
Rules across components live in `interactions.py` (called by `rl`).
Derived defaults (`resolved_*` properties) follow DESIGN.md; this module never imports torch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from prime_async.config.base import BaseConfig
from prime_async.config.env import EnvConfig, EvalEnvConfig, SamplingOverrides, check_unique_names
from prime_async.config.moved import refuse_moved
from prime_async.config.shared import (
    DEFAULT_OUTPUT_DIR,
    RUN_ID_DESCRIPTION,
    LogConfig,
    LoraConfig,
    ModelConfig,
    TransportConfig,
    WandbConfig,
    WeightsConfig,
)

MOVED_KEYS = {  # old key -> its key now: each gives a one-line error naming the new key
    "pause_mode": "weights.pause_mode",
    "update_weights_interval": "weights.update_interval",
    "weight_poll_interval_s": "weights.poll_interval_s",
    **{key: f"admission.{key}" for key in (
        "max_inflight_groups", "max_buffered_groups", "submission_granularity", "unused_handler",
        "max_dropped_groups_per_step", "fail_fast_groups",
    )},
    **{key: f"batch.packing.{key}" for key in ("num_train_ranks", "share_prompt_prefix")},
    **{key: f"batch.{key}" for key in ("sink", "advantage", "packing")},
    **{key: f"data.{key}" for key in ("seed", "shuffle", "ckpt")},
    "resume": "data.ckpt.resume",
    **{key: f"inference.{key}" for key in ("run_id", "lora", "router_replay")},
}  # fmt: skip


def check_weights(cfg: OrchestratorConfig) -> None:
    """`weights.transport` against the sections that use it: eval while training reads the broadcast
    directory (filesystem only); `shared` keeps trainer and engines on one host."""
    transport = cfg.weights.transport
    if transport != "filesystem" and cfg.eval.envs:
        raise ValueError(
            f"eval.envs with weights.transport = '{transport}': eval while training finds its versions "
            f"in the broadcast directory, which the {transport} transport writes only at checkpoint "
            "steps; use weights.transport = 'filesystem' for a run with eval"
        )
    if transport == "shared":
        _check_shared_hosts(cfg)


def _check_shared_hosts(cfg: OrchestratorConfig) -> None:
    """`weights.transport = "shared"`: the trainer (it connects to `transport.host`) and every engine on
    this host, reached over loopback; the engine checks the trainer's hostname again when it maps."""
    from urllib.parse import urlsplit

    loopback = {"127.0.0.1", "localhost", "::1"}
    for i, url in enumerate(cfg.inference.base_urls):
        host = urlsplit(url).hostname or ""
        if host not in loopback:
            raise ValueError(
                f"weights.transport = 'shared' with inference.base_urls[{i}] = {url!r}: the engines map the "
                "trainer's shared memory, so trainer and engines must run on one host (loopback URLs); use "
                "weights.transport = 'distributed' or 'filesystem' across hosts"
            )
    if cfg.transport.host not in loopback:
        raise ValueError(
            f"weights.transport = 'shared' with transport.host = {cfg.transport.host!r}: trainer and engines "
            "must run on one host (the trainer connects over loopback); use weights.transport = "
            "'distributed' or 'filesystem' across hosts"
        )


class InferenceClientConfig(BaseConfig):
    """`[orchestrator.inference]`: which inference engines the orchestrator talks to (SGLang native HTTP
    API), and what it expects of them: the run they belong to (`run_id`), the LoRA adapters they load
    (`lora`), the routed experts they return (`router_replay`). Under `rl` every key here is set by `rl`
    (the engines it starts, and its `run_id`, `lora`, `router_replay`)."""

    base_urls: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:30000"],
        min_length=1,
        description="Base URLs of the inference engines (SGLang servers or the embedded engine).",
    )
    api_key: str | None = Field(None, description="Bearer token sent to the engines, if they require one.")
    max_running_requests: int = Field(
        32, ge=1, description="Requests one engine runs at once; used for the derived `max_inflight_groups`."
    )
    timeout_s: float = Field(600.0, gt=0, description="HTTP timeout of one engine request.")
    run_id: str | None = Field(None, description=RUN_ID_DESCRIPTION)
    lora: LoraConfig | None = Field(
        None,
        description="The run trains LoRA adapters: each update loads broadcast `step_N` with "
        "`/load_lora_adapter` as `v<N>` and every request names the adapter of the version it runs at "
        "(`lora_path`). None = full-weight updates (`/update_weights_from_disk`). Set by `rl` (`lora`).",
    )
    router_replay: bool = Field(
        False,
        description="MoE routing replay (R3): every model call asks the engine for the experts each token "
        "was routed to; episodes and batches carry them to the trainer. Set by `rl` (`router_replay`).",
    )


class SinkConfig(BaseConfig):
    """The train sink: what is kept, dropped, and in which order groups are taken into a batch."""

    import_path: str | None = Field(
        None,
        description="Replace the default sink with `module:Class` (the `Sink` protocol of "
        "orchestrator/train_sink.py: put/get_batch over the group table); the other fields apply only if "
        "that class reads them.",
    )
    order: Literal["fifo", "windowed_fifo"] = Field(
        "fifo",
        description="fifo = finished groups of the oldest dispatch version first (arrival order among "
        "equals); windowed_fifo = groups are taken in dispatch "
        "order, out of order only within a window (MiniMax Forge), so slow groups inside it hold the batch.",
    )
    window_fraction: float = Field(
        0.3, ge=0.0, le=10.0, description="Window of windowed_fifo as a fraction of `batch_groups`."
    )
    stragglers: Literal["partial", "wait"] = Field(
        "wait",
        description="A group still in flight when the batch it is due in could be cut: `partial` = cut "
        "without it once `straggler_wait_s` passed; it keeps generating under the newer weights and lands "
        "in a later batch, its loss tokens sampled more than max_off_policy_steps versions before that "
        "batch masked (counted in `ledger/tokens/masked_stale`): K bounds every trained token. `wait` = "
        "the cut waits for it (K bounds every trained group's dispatch version; a batch waits for its "
        "slowest group, as a synchronous run does). deterministic = true always waits.",
    )
    straggler_wait_s: float | None = Field(
        None,
        ge=0.0,
        description="stragglers = partial: how long a batch that could be cut waits for a group in flight "
        "that would miss its deadline without it. None = adaptive: a multiple of the step time, raised while "
        "more than `discard_budget` of the generated tokens are discarded as stale and lowered while well "
        "under it (orchestrator/straggler_budget.py).",
    )
    discard_budget: float = Field(
        0.02,
        ge=0.0,
        le=1.0,
        description="stragglers = partial, straggler_wait_s = None: the share of generated loss tokens the "
        "adaptive straggler wait aims to keep discarded as stale (masked at a cut, or dropped).",
    )
    reject_equal_reward: bool = Field(
        False, description="Drop groups whose rewards are all equal (no signal for a group baseline)."
    )
    overlong: Literal["truncate", "drop"] = Field(
        "truncate",
        description="Episodes that outgrow `seq_len` (a turn whose prompt does not fit, which ends the "
        "episode there, or a reply clamped at seq_len): `truncate` = train the episode up to there (flagged "
        "`truncated`), `drop` = drop the episode (counted as filtered). Either way it is counted in "
        "`env/<name>/overflow_episodes` and shown on the progress line.",
    )


class AdmissionConfig(BaseConfig):
    """`[orchestrator.admission]`: how many groups are issued and held, what becomes of unused ones, and
    when drops or failures end the run (`orchestrator/admission.py`, `groups.py`, `dispatcher.py`)."""

    max_inflight_groups: int | None = Field(
        None,
        ge=1,
        description="Groups issued and not returned. None = ceil(max_running_requests * engines * 1.2 / "
        "group_size).",
    )
    max_buffered_groups: int | None = Field(
        None,
        ge=1,
        description="In-flight plus finished-but-untrained groups. None = (max_off_policy_steps + 1) * "
        "batch_groups, the most that can ever ship; admission's landing rule admits fewer whenever the "
        "orchestrator runs ahead of the served version (a new group only if the batch it lands in is "
        "within K of the served version), so nothing admitted is cancelled or ages past K.",
    )
    submission_granularity: Literal["sample", "group"] = Field(
        "sample",
        description="sample = each finished episode frees its own slot; group = the slot is held until the "
        "whole group returns.",
    )
    unused_handler: Literal["drop", "retry"] = Field(
        "drop",
        description="Stale or errored groups: drop the prompt, or retry it (back into the data source). "
        "Filtered groups are always dropped; a cancelled group's prompt is always retried (except with "
        "deterministic = true, where this setting applies), so slow prompts are not selected against.",
    )
    max_dropped_groups_per_step: int | None = Field(
        None,
        ge=1,
        description="Fail the run when more groups are dropped between two batch cuts. "
        "None = 10 * batch_groups.",
    )
    fail_fast_groups: int = Field(
        2,
        ge=0,
        description="Stop the run at once, naming the cause, when every episode of the first this many "
        "finished groups failed (the environment, or the distillation teacher, cannot run as configured). "
        "0 = never.",
    )


def check_admission(cfg: OrchestratorConfig) -> None:
    """`admission` against K and the batch: the buffer holds a batch, every awaited version is loaded
    (a buffer larger than the landing rule can ever fill is a warning of `lint.py`)."""
    buffered = cfg.resolved_max_buffered_groups
    if buffered < cfg.batch_groups:
        raise ValueError(
            f"admission.max_buffered_groups ({buffered}) < batch_groups ({cfg.batch_groups}): set "
            "admission.max_buffered_groups >= batch_groups (default (max_off_policy_steps + 1) * "
            "batch_groups)"
        )
    if cfg.weights.update_interval > cfg.max_off_policy_steps + 1:
        raise ValueError(
            f"weights.update_interval ({cfg.weights.update_interval}) > max_off_policy_steps + 1 "
            f"({cfg.max_off_policy_steps + 1}): admission would wait for a version never loaded; lower "
            "weights.update_interval or raise max_off_policy_steps"
        )


class PackingConfig(BaseConfig):
    """`[orchestrator.batch.packing]`: how a batch is laid out for the trainer (orchestrator/batching.py)."""

    num_train_ranks: int = Field(
        1,
        ge=1,
        description="Trainer data-parallel ranks a batch is split across (`rl`: trainer.num_processes).",
    )
    share_prompt_prefix: bool = Field(
        True,
        description="Pack the episodes of one group (per seat) as their common prompt once plus a branch "
        "per episode, so the trainer runs the shared tokens once per group instead of once per episode "
        "(same logprobs and gradients; fsdp runs an explicit attention mask for such rows, megatron "
        "expands them back). false = every episode whole.",
    )


class AdvantageConfig(BaseConfig):
    """Group-relative advantages: reward minus the group mean."""

    std_normalize: bool = Field(False, description="Divide by the group's reward std (GRPO-style).")
    eps: float = Field(1e-6, gt=0, description="Added to the std before dividing.")


class BatchConfig(BaseConfig):
    """`[orchestrator.batch]`: how finished groups become the trainer's batch: which are kept and in what
    order (`sink`), their advantages (`advantage`), the layout (`packing`). The batch's size and
    staleness stay top-level (`batch_groups`, `group_size`, `max_off_policy_steps`)."""

    sink: SinkConfig = Field(default_factory=SinkConfig, description="Train sink.")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="Advantages.")
    packing: PackingConfig = Field(default_factory=PackingConfig, description="Batch layout for the trainer.")


class SamplingConfig(BaseConfig):
    """Sampling parameters sent with every generation request."""

    temperature: float = Field(1.0, gt=0, description="Sampling temperature (the trainer uses the same).")
    max_tokens: int = Field(128, ge=1, description="Max new tokens per model turn.")
    top_p: float = Field(1.0, gt=0, le=1.0, description="Nucleus sampling threshold.")


def check_envs(cfg: OrchestratorConfig) -> None:
    """`envs` and `sampling`: unique env names; no nucleus truncation on trained episodes (the engines
    report each token's logprob under the untruncated distribution, so the importance ratio against them
    would be biased)."""
    check_unique_names(list(cfg.envs), "envs")
    trained = [("orchestrator.sampling.top_p", cfg.sampling.top_p)]
    trained += [(f"orchestrator.envs[{e.label}].sampling.top_p", e.sampling.top_p) for e in cfg.envs]
    for key, top_p in trained:
        if top_p is not None and top_p < 1.0:
            raise ValueError(
                f"{key} = {top_p} with the trainer's importance-ratio loss: engines report sampler logprobs "
                "of the untruncated distribution, so the ratio would be biased; train with top_p = 1 "
                "(eval sampling may set any top_p)"
            )


class OrchestratorEvalConfig(BaseConfig):
    """Evaluation while training: held-out environments, when, and on which engines."""

    envs: list[EvalEnvConfig] = Field(
        default_factory=list, description="Eval environments (`[[orchestrator.eval.envs]]`); empty = no eval."
    )
    interval: int | None = Field(
        None,
        ge=1,
        description="Evaluate every weights version that is a multiple of this (None = only "
        "at the start and the end).",
    )
    at_start: bool = Field(True, description="Evaluate version 0 (the initial model).")
    at_end: bool = Field(True, description="Evaluate the final version (`max_steps`) after the last batch.")
    placement: Literal["shared", "dedicated", "external"] = Field(
        "shared",
        description="shared = the training engines (an eval pins their version: a weight update waits for "
        "the running eval); dedicated = engines of their own (`eval.base_urls`, launched by `rl` from "
        "`[eval_inference]`) that load each evaluated version; external = any SGLang-compatible server "
        "at `eval.base_urls` that can read the run's broadcasts directory.",
    )
    base_urls: list[str] = Field(
        default_factory=list, description="Engines of the dedicated/external placement (none for shared)."
    )
    api_key: str | None = Field(None, description="Bearer token of the dedicated/external engines.")
    sampling: SamplingOverrides = Field(
        default_factory=SamplingOverrides,
        description="Eval sampling: overrides of `sampling` (each eval env may override again).",
    )
    max_concurrent_episodes: int = Field(32, ge=1, description="Eval episodes running at once.")
    samples: bool = Field(
        True, description="Write every eval episode to output_dir/eval/samples_v<version>.jsonl."
    )
    wandb_table: bool = Field(True, description="Log the samples as a wandb table (when wandb is on).")
    final_timeout_s: float = Field(
        600.0, gt=0, description="How long the end-of-run eval waits for the trainer's final broadcast."
    )

    @model_validator(mode="after")
    def _check(self) -> OrchestratorEvalConfig:
        check_unique_names(list(self.envs), "eval.envs")
        if self.placement == "shared" and self.base_urls:
            raise ValueError(
                "eval.base_urls: the shared placement evaluates on the training engines; set "
                'eval.placement = "dedicated" or "external" to use other engines'
            )
        if self.placement != "shared" and self.envs and not self.base_urls:
            raise ValueError(
                f"eval.base_urls: placement {self.placement!r} needs the eval engines' URLs (rl fills them "
                "from [eval_inference] for dedicated)"
            )
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.envs)


class TeacherConfig(BaseConfig):
    """On-policy distillation: a teacher scores every sampled token of every finished episode (prompt
    logprobs of the episode's tokens on the teacher's engines), and the trainer adds
    `kl_weight * (teacher logprob - sampler logprob)` to each token's advantage (`trainer/opd.py`)."""

    model: str | None = Field(
        None,
        description="The teacher's model directory: `rl` starts an embedded engine serving it "
        "([teacher_inference]) and fills base_urls. Standalone orchestrators give base_urls instead.",
    )
    base_urls: list[str] = Field(
        default_factory=list, description="Engines serving the teacher (SGLang or embedded `/generate`)."
    )
    api_key: str | None = Field(None, description="Bearer token of the teacher's engines.")
    kl_weight: float = Field(1.0, gt=0, description="Weight of the per-token reverse-KL advantage term.")
    env_weight: float = Field(
        0.0, ge=0, description="Weight of the environment's advantage (0 = distillation alone; 1 = added)."
    )
    batch_episodes: int = Field(
        8, ge=1, description="Episodes scored in one request (forced to 1 with deterministic = true)."
    )
    max_concurrent_requests: int = Field(4, ge=1, description="Scoring requests in flight at once.")
    timeout_s: float = Field(120.0, gt=0, description="HTTP timeout of one scoring request.")
    outage_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long a teacher outage (refused/reset connection, timeout, HTTP 502/503/504) is "
        "waited out: finished groups wait for scoring and requests are retried with backoff; past it "
        "the run fails naming the teacher.",
    )

    @model_validator(mode="after")
    def _check(self) -> TeacherConfig:
        if self.model is None and not self.base_urls:
            raise ValueError(
                "orchestrator.teacher: set model (under rl) or base_urls (the teacher's engines)"
            )
        return self


class OrchestratorCkptConfig(BaseConfig):
    """Orchestrator checkpoints: data-source position and the prompts issued but not yet trained."""

    interval: int | None = Field(
        None, ge=1, description="Save every this many steps (None = never). Match the trainer's interval."
    )
    resume: bool = Field(
        False, description="Resume from the latest checkpoint under output_dir/checkpoints (rl: on restart)."
    )


class DataConfig(BaseConfig):
    """`[orchestrator.data]`: the prompt stream: the order examples are drawn in (`seed`, `shuffle`) and
    its checkpoints (`ckpt`: each env's data position and the prompts issued but not yet trained)."""

    seed: int = Field(0, description="Seed of the data order (and, when deterministic, of sampling).")
    shuffle: bool = Field(True, description="Shuffle the examples every epoch (seeded).")
    ckpt: OrchestratorCkptConfig = Field(default_factory=OrchestratorCkptConfig, description="Checkpoints.")


def check_deterministic(cfg: OrchestratorConfig) -> None:
    """`deterministic = true` fixes what timing would decide: every version loaded in turn, the default
    batch.sink, one env, no retried prompts (a retried prompt or a handed-back mix slot goes to whichever slot
    comes next)."""
    if cfg.weights.update_interval != 1:
        raise ValueError(
            f"deterministic = true loads every version in turn: weights.update_interval must be 1 "
            f"(got {cfg.weights.update_interval})"
        )
    if cfg.batch.sink.import_path is not None:
        raise ValueError(
            f"deterministic = true composes batches by its own schedule: remove batch.sink.import_path "
            f"({cfg.batch.sink.import_path!r})"
        )
    if len(cfg.envs) > 1:
        raise ValueError(
            f"deterministic = true with {len(cfg.envs)} orchestrator.envs: a filtered or errored group hands "
            "its mix slot back when it finishes, so which env a later slot gets depends on timing; train one "
            "env per deterministic run, or set deterministic = false"
        )
    if cfg.admission.unused_handler == "retry":
        raise ValueError(
            "deterministic = true with orchestrator.admission.unused_handler = 'retry': a retried prompt "
            "takes whichever slot comes next, which depends on timing; set admission.unused_handler = "
            "'drop' (the default)"
        )


class OrchestratorConfig(BaseConfig):
    """Loads environments, dispatches groups, holds the train sink, streams batches, drives weight updates."""

    shorthands: ClassVar[dict[str, str]] = {"env": "envs"}

    model: ModelConfig = Field(default_factory=ModelConfig, description="Model (tokenizer for the env).")
    output_dir: Path = Field(
        DEFAULT_OUTPUT_DIR, description="Run directory: broadcasts/, checkpoints/, metrics/ live under it."
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="wandb logging.")
    log: LogConfig = Field(default_factory=LogConfig, description="Console logging.")
    seq_len: int = Field(2048, ge=8, description="Max tokens of one micro-batch (and of one sample).")
    max_steps: int = Field(20, ge=1, description="Number of batches to produce (trainer steps).")
    envs: list[EnvConfig] = Field(
        default_factory=lambda: [EnvConfig()],
        min_length=1,
        description="Training environments (`[[orchestrator.envs]]`), mixed by `ratio` with a "
        "deterministic, resumable schedule (each env keeps its own data position). Default: one env "
        "with every default (reverse-text). Config files and flags may give one as `[env]` (the "
        "loader's shorthand for `envs = [env]`).",
    )
    eval: OrchestratorEvalConfig = Field(
        default_factory=OrchestratorEvalConfig, description="Evaluation while training."
    )
    inference: InferenceClientConfig = Field(
        default_factory=InferenceClientConfig, description="Inference engines."
    )
    transport: TransportConfig = Field(
        default_factory=TransportConfig, description="ZeroMQ batch stream to the trainer."
    )
    batch_groups: int = Field(8, ge=1, description="Groups per training batch.")
    group_size: int = Field(4, ge=1, description="Episodes per group (same prompt).")
    max_off_policy_steps: int = Field(
        8, ge=0, description="K: no group with `step - dispatch_version > K` is ever trained; 0 = sync."
    )
    weights: WeightsConfig = Field(
        default_factory=WeightsConfig,
        description="Weight updates: pause mode, interval, transport (the same section as the trainer's).",
    )
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig, description="Groups issued and held, unused ones, drop limits."
    )
    batch: BatchConfig = Field(
        default_factory=BatchConfig, description="Finished groups into the batch: sink, advantage, packing."
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling parameters.")
    data: DataConfig = Field(
        default_factory=DataConfig, description="Prompt order (seed, shuffle) and its checkpoints (ckpt)."
    )
    deterministic: bool = Field(
        False,
        description="Bit-reproducible run: fixed dispatch schedule (the groups of batch n are dispatched "
        "when version max(0, n - K) is served, in order), batches composed by dispatch order, per-episode "
        "sampling seeds from `data.seed` and the example, versions loaded one by one with `drain` "
        "(weights.pause_mode and batch.sink.order are ignored). Costs throughput; `rl` sets it on every "
        "component.",
    )
    teacher: TeacherConfig | None = Field(
        None, description="On-policy distillation from a teacher model (None = off)."
    )

    @property
    def resolved_max_inflight_groups(self) -> int:
        if self.admission.max_inflight_groups is not None:
            return self.admission.max_inflight_groups
        capacity = self.inference.max_running_requests * len(self.inference.base_urls) * 1.2
        return max(1, math.ceil(capacity / self.group_size))

    @property
    def resolved_max_buffered_groups(self) -> int:
        if self.admission.max_buffered_groups is not None:
            return self.admission.max_buffered_groups
        return (self.max_off_policy_steps + 1) * self.batch_groups

    @property
    def resolved_max_dropped_groups_per_step(self) -> int:
        if self.admission.max_dropped_groups_per_step is not None:
            return self.admission.max_dropped_groups_per_step
        return 10 * self.batch_groups

    @model_validator(mode="before")
    @classmethod
    def _refuse_moved_keys(cls, data: Any) -> Any:
        """A key that moved into a section: one line naming its new key (`MOVED_KEYS`)."""
        return refuse_moved(data, MOVED_KEYS, "orchestrator")

    @model_validator(mode="after")
    def _check_envs(self) -> OrchestratorConfig:
        check_envs(self)
        return self

    @model_validator(mode="after")
    def _check_admission(self) -> OrchestratorConfig:
        check_admission(self)
        return self

    @model_validator(mode="after")
    def _check_weights(self) -> OrchestratorConfig:
        check_weights(self)
        return self

    @model_validator(mode="after")
    def _check_deterministic(self) -> OrchestratorConfig:
        if self.deterministic:
            check_deterministic(self)
        return self
