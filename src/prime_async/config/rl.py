"""Config schema of `uv run rl`: one file for a whole run, split into the three component configs.

`prime_async.entrypoints.rl` parses it (`rl @ rl.toml`, `rl @ rl.toml --trainer @ t.toml`,
`rl @ rl.toml --trainer.optim.lr 1e-5`) and hands it to `prime_async.launcher.run`, which writes
`inference`, `orchestrator` and `trainer` out as TOML and starts each command from its file.

Propagation is one explicit step (`propagate`) on the raw values the user gave, before validation, so
that each sub-config is validated once, with its final values; no pydantic internals are edited:

```
 rl: model seq_len max_steps output_dir wandb log transport deterministic router_replay ──► every
     run_id lora                                  sub-config that has the field (the orchestrator
                                                  keeps run_id, lora, router_replay in `inference`)
 rl: weights.<transport, backend, bucket_mb, ...>           ──► orchestrator.weights.*, trainer.weights.*
 inference.server.host/port (+ sglang.num_engines)          ──► orchestrator.inference.base_urls
 inference.server.api_key                                   ──► orchestrator.inference.api_key
 inference.engine / sglang max_running_requests             ──► orchestrator.inference.max_running_requests
 orchestrator.max_off_policy_steps // weights.update_interval ──► inference.max_loaded_loras (with lora,
     + 2 (`interactions.lora_slots_needed`)                       when unset; a smaller one is refused)
 orchestrator.max_off_policy_steps                          ──► trainer.max_off_policy_steps
 trainer.ckpt.interval                                      ──► orchestrator.data.ckpt.interval (if unset;
                                                               a given one must divide it)
 trainer.num_processes                                      ──► orchestrator.batch.packing.num_train_ranks
 rl shared fields, except transport                         ──► eval_inference (when given)
 eval_inference.server.host/port                            ──► orchestrator.eval.base_urls
 orchestrator.teacher.model (without teacher.base_urls)     ──► teacher_inference.model.path (rl starts
     + rl shared fields except model, lora, router_replay      the teacher's engine; port 0 = a free one)
 teacher_inference.server.host/port                         ──► orchestrator.teacher.base_urls
```

Invariants:
- after validation every propagated key holds the same value in source and target;
- the given values are kept (`given_values()`, `explicit_values(cfg)`): they validate into the same config,
  and a change is a new config built from them (`with_values`; RLConfig is frozen), so shared values
  and values derived from K propagate again and only given values count as explicit;
- an explicit value in a target that differs from its source is an error naming both keys (setting the
  same value twice is allowed); an invalid explicit value is left for pydantic to report;
- all components share one `output_dir`, laid out as: `configs/` (the resolved sub-configs), `logs/`
  (one log per component), `metrics/<component>.jsonl`, `broadcasts/step_<n>/` (trainer writes, the
  orchestrator reads), `checkpoints/`.
This module imports the three component schemas, so a broken schema breaks only `rl` and its own command.
"""

from __future__ import annotations

import copy
import ipaddress
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from prime_async.config.base import BaseConfig
from prime_async.config.dicts import KeyPath, lookup, put
from prime_async.config.inference import InferenceConfig
from prime_async.config.interactions import (
    check_rl,
    derive_keep_last,
    derive_lora_slots,
)
from prime_async.config.moved import refuse_moved
from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.config.placement import GpusConfig
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
from prime_async.config.trainer import TrainerConfig

SUBSECTIONS: dict[str, type[BaseModel]] = {
    "inference": InferenceConfig,
    "orchestrator": OrchestratorConfig,
    "trainer": TrainerConfig,
}
SHARED_FIELDS = (
    "model", "seq_len", "max_steps", "output_dir", "wandb", "log", "transport", "run_id", "deterministic",
    "lora", "router_replay",
)  # fmt: skip
SHARED_PATHS: dict[str, dict[str, KeyPath]] = {  # section -> shared field -> its key there, when not (field,)
    "orchestrator": {name: ("inference", name) for name in ("run_id", "lora", "router_replay")},
}
TEACHER_SHARED_FIELDS = ("seq_len", "max_steps", "output_dir", "wandb", "log", "run_id", "deterministic")
ENGINE_SECTIONS = ("inference", "eval_inference", "teacher_inference")  # the engines rl may launch
_UNSPECIFIED_HOSTS = {"0.0.0.0", "::"}
ORCHESTRATOR_CKPT_INTERVAL: KeyPath = ("data", "ckpt", "interval")
WEIGHT_TARGETS = ("orchestrator", "trainer")  # sub-configs whose `weights` section holds every transfer key


class LaunchConfig(BaseConfig):
    """How `rl` starts its components (`launcher/rl.py`, `launcher/forking.py`)."""

    startup_timeout_s: float = Field(
        600.0, gt=0, description="How long `rl` waits for inference to be healthy before failing."
    )
    fork_components: bool = Field(
        True,
        description="On a CPU run, start the components (and their restarts) as forks of `rl`, which imports "
        "torch, transformers and verifiers once, instead of fresh interpreters (~4-8 s of CPU saved per "
        "start; `ps` shows `orchestrator @ <config>`). Runs with a GPU component always exec them.",
    )


MOVED_KEYS = {"startup_timeout_s": "launch.startup_timeout_s"}  # old key -> its key now (one-line error)


class RestartConfig(BaseConfig):
    """What `rl` does when a component dies (see `launcher/restart.py`)."""

    max_restarts: int = Field(
        0,
        ge=0,
        description="Restarts allowed per component (0 = any death fails the run). Inference comes back "
        "with the newest STABLE broadcast, the teacher's engine with its own config, trainer and "
        "orchestrator resuming (trainer.ckpt.resume, orchestrator.data.ckpt.resume).",
    )
    backoff_s: float = Field(1.0, ge=0, description="Seconds to wait before restarting a dead component.")


class RLConfig(BaseConfig):
    """`uv run rl @ rl.toml`: shared run settings plus the inference, orchestrator and trainer sections.

    Frozen: a changed value must propagate again, so a change is a new config (`with_values`)."""

    model_config = ConfigDict(frozen=True)

    model: ModelConfig = Field(default_factory=ModelConfig, description="Model of every component.")
    seq_len: int = Field(2048, ge=8, description="Max tokens of one sample / micro-batch (all components).")
    max_steps: int = Field(20, ge=1, description="Trainer steps (= batches the orchestrator produces).")
    output_dir: Path = Field(
        DEFAULT_OUTPUT_DIR,
        description="Run directory shared by all components: configs/, logs/, metrics/, broadcasts/, "
        "checkpoints/.",
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="wandb logging of every component.")
    log: LogConfig = Field(default_factory=LogConfig, description="Console logging of every component.")
    transport: TransportConfig = Field(
        default_factory=TransportConfig, description="ZeroMQ batch stream orchestrator -> trainer."
    )
    weights: WeightsConfig = Field(
        default_factory=WeightsConfig,
        description="Weight transfer trainer -> inference, copied into orchestrator.weights and "
        'trainer.weights (`weights.transport = "distributed"` for torch.distributed).',
    )
    gpus: GpusConfig = Field(
        default_factory=GpusConfig,
        description="CUDA devices of each process rl starts (CUDA_VISIBLE_DEVICES); unset keys are placed "
        "by rl, overlaps that cannot run are refused at start (config/placement.py, docs/gpu.md).",
    )
    run_id: str | None = Field(None, description=RUN_ID_DESCRIPTION)
    deterministic: bool = Field(
        False,
        description="Bit-reproducible run (copied into every component): the same config and seed give "
        "the same rewards, losses and published weights on CPU, and K = 0 equals the synchronous run "
        "step for step. Fixed dispatch schedule, seeded sampling, batch-invariant inference, "
        "deterministic torch. Costs throughput (scripts/bench_deterministic.py).",
    )
    router_replay: bool = Field(
        False,
        description="MoE routing replay (R3), copied into every component: engines return the experts each "
        "sampled token was routed to, batches carry them, the trainer's MoE layers reuse them. Needs an MoE "
        "model (Qwen3-MoE family).",
    )
    lora: LoraConfig | None = Field(
        None,
        description="Train and serve LoRA adapters (trainer.lora, inference.lora, "
        "orchestrator.inference.lora); None = full weights.",
    )
    launch: LaunchConfig = Field(
        default_factory=LaunchConfig, description="How `rl` starts its components (`launcher/`)."
    )
    restart: RestartConfig = Field(
        default_factory=RestartConfig, description="Restart of dead components (budget per component)."
    )
    inference: InferenceConfig = Field(
        default_factory=InferenceConfig,
        description="Inference section (shared fields come from the top level; `--inference @ file.toml`).",
    )
    orchestrator: OrchestratorConfig = Field(
        default_factory=OrchestratorConfig,
        description="Orchestrator section (shared fields come from the top level; `--orchestrator @ f`).",
    )
    trainer: TrainerConfig = Field(
        default_factory=TrainerConfig,
        description="Trainer section (shared fields come from the top level; `--trainer @ file.toml`).",
    )
    eval_inference: InferenceConfig | None = Field(
        None,
        description='Dedicated eval engines `rl` launches (orchestrator.eval.placement = "dedicated"): an '
        "inference section of their own (e.g. a second embedded engine on another port); shared fields "
        "come from the top level and its URLs become orchestrator.eval.base_urls.",
    )

    teacher_inference: InferenceConfig | None = Field(
        None,
        description="The teacher's engine `rl` launches for on-policy distillation: derived from "
        "orchestrator.teacher.model (an embedded engine on a free port); set keys here to change it (e.g. "
        "backend = 'sglang'). Its URLs become orchestrator.teacher.base_urls.",
    )

    _given: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _propagate(cls, data: Any, handler: ModelWrapValidatorHandler[RLConfig]) -> RLConfig:
        """The explicit propagation step: the given values (kept as `given_values()`) are copied into
        the sections on a raw dict, which is then validated once; a propagated value is never given."""
        if not isinstance(data, dict):
            return handler(data)
        given = {key: _as_raw(value) for key, value in data.items()}
        cfg = handler(propagate(cls, copy.deepcopy(given)))
        cfg._given = given
        return cfg

    def given_values(self) -> dict[str, Any]:
        """What the user gave (before propagation): it validates into this same config again."""
        return copy.deepcopy(self._given)

    def __eq__(self, other: object) -> bool:
        """Equal resolved values: what was given (`given_values`) is provenance, not value."""
        if not isinstance(other, RLConfig):
            return NotImplemented
        return dict(self) == dict(other)

    def with_values(self, **changes: Any) -> RLConfig:
        """This config with top-level keys changed, propagated again (the config itself is frozen)."""
        return type(self).model_validate({**self.given_values(), **changes})

    @model_validator(mode="before")
    @classmethod
    def _refuse_moved_keys(cls, data: Any) -> Any:
        """A key that moved into a section: one line naming its new key (`MOVED_KEYS`)."""
        return refuse_moved(data, MOVED_KEYS, "rl")

    @model_validator(mode="after")
    def _check_interactions(self) -> RLConfig:
        """Combinations across components that cannot train together (`interactions.py`)."""
        check_rl(self)
        return self


def propagate(cls: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """`data` (raw, given values) with the shared and derived values copied into the sections that
    take them (the table in the module docstring); an explicit different value is an error."""
    subs = {name: data.get(name, {}) for name in SUBSECTIONS}
    if not all(isinstance(sub, dict) for sub in subs.values()):
        return data  # e.g. `inference = "x"`: pydantic reports the section's type
    subs = {name: dict(sub) for name, sub in subs.items()}
    for name in SHARED_FIELDS:
        _propagate_shared(cls, data, subs, name)
    _propagate_weights(cls, data, subs)
    _propagate_links(subs)
    _align_checkpoint_steps(subs)
    _derive_from_k(data, subs)
    data.update(subs)
    _propagate_eval_inference(cls, data)
    _propagate_teacher_inference(cls, data)
    return data


# -------------------------------------------------------------------------------------------- raw data


class _Unresolved(Exception):
    """A source value that does not validate: nothing is propagated, pydantic reports it later."""


def _as_raw(value: Any) -> Any:
    """Sub-configs given as model instances (Python callers) become dicts of their explicitly set values."""
    if isinstance(value, BaseModel):
        return explicit_values(value)
    if isinstance(value, dict):
        return {key: _as_raw(item) for key, item in value.items()}
    return value


def explicit_values(model: BaseModel) -> dict[str, Any]:
    """The explicitly set fields of `model`, recursively, plus every union tag (a one-value `Literal`,
    e.g. `type = "mask"`) so that the dict validates into the same variant again; of an `RLConfig`, what
    was given (`given_values`), so that it validates into the same config."""
    if isinstance(model, RLConfig):
        return model.given_values()
    out: dict[str, Any] = {}
    for name, info in type(model).model_fields.items():
        is_tag = typing.get_origin(info.annotation) is Literal and len(typing.get_args(info.annotation)) == 1
        if name in model.model_fields_set or is_tag:
            value = getattr(model, name)
            out[name] = explicit_values(value) if isinstance(value, BaseModel) else value
    return out


def _adapter(info: Any) -> TypeAdapter:
    annotation = Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation
    return TypeAdapter(annotation)


def _field(cls: type[BaseModel], path: KeyPath) -> Any | None:
    """FieldInfo at `path` inside `cls` (through nested models), or None when the schema has no such key."""
    info = None
    current: type[BaseModel] | None = cls
    for segment in path:
        if current is None or segment not in current.model_fields:
            return None
        info = current.model_fields[segment]
        annotation = info.annotation
        current = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return info


def resolved(cls: type[BaseModel], raw: dict[str, Any], path: KeyPath) -> Any:
    """The value `cls` will hold at `path` given `raw`: the validated explicit value, else the default."""
    info = _field(cls, path)
    assert info is not None, f"{cls.__name__} has no key {'.'.join(path)}"
    present, value = lookup(raw, path)
    if not present:
        return info.get_default(call_default_factory=True, validated_data={})
    try:
        return _adapter(info).validate_python(value)
    except ValidationError:
        raise _Unresolved from None


# ---------------------------------------------------------------------------------------- propagation


def _propagate_shared(cls: type[BaseModel], data: dict[str, Any], subs: dict[str, dict], name: str) -> None:
    try:
        value = resolved(cls, data, (name,))
    except _Unresolved:
        return
    for sub_name, sub_cls in SUBSECTIONS.items():
        path = SHARED_PATHS.get(sub_name, {}).get(name, (name,))
        _assign(sub_cls, subs[sub_name], path, value, target=f"{sub_name}.{'.'.join(path)}", source=name)


def _propagate_weights(cls: type[BaseModel], data: dict[str, Any], subs: dict[str, dict]) -> None:
    """Each key of rl's `weights` into `orchestrator.weights` and `trainer.weights` (the trainer's section
    adds `keep_last`, which stays its own)."""
    for name in WeightsConfig.model_fields:
        try:
            value = resolved(cls, data, ("weights", name))
        except _Unresolved:
            continue
        for sub_name in WEIGHT_TARGETS:
            _assign(SUBSECTIONS[sub_name], subs[sub_name], ("weights", name), value,
                    target=f"{sub_name}.weights.{name}", source=f"weights.{name}")  # fmt: skip


def _links(subs: dict[str, dict]) -> list[tuple[str, KeyPath, str, Callable[[], Any]]]:
    """(target section, key path in it, source name, value from the raw sections) of every derived value."""
    inference, orchestrator, trainer = subs["inference"], subs["orchestrator"], subs["trainer"]
    return [
        ("orchestrator", ("inference", "base_urls"), "inference.server.host/port",
         lambda: engine_urls(inference)),
        ("orchestrator", ("inference", "api_key"), "inference.server.api_key",
         lambda: _inf(inference, ("server", "api_key"))),
        ("orchestrator", ("inference", "max_running_requests"), "inference max_running_requests",
         lambda: engine_capacity(inference)),
        ("trainer", ("max_off_policy_steps",), "orchestrator.max_off_policy_steps",
         lambda: resolved(OrchestratorConfig, orchestrator, ("max_off_policy_steps",))),
        ("orchestrator", ("batch", "packing", "num_train_ranks"), "trainer.num_processes",
         lambda: resolved(TrainerConfig, trainer, ("num_processes",))),
    ]  # fmt: skip


def _propagate_links(subs: dict[str, dict]) -> None:
    for target_name, path, source, compute in _links(subs):
        try:
            value = compute()
        except _Unresolved:
            continue
        if value is not None:
            target = f"{target_name}.{'.'.join(path)}"
            _assign(SUBSECTIONS[target_name], subs[target_name], path, value, target=target, source=source)


def _align_checkpoint_steps(subs: dict[str, dict]) -> None:
    """The orchestrator checkpoints on the trainer's checkpoint steps (a restart resumes both there).

    Unset `orchestrator.data.ckpt.interval` takes `trainer.ckpt.interval`; a given one must divide it."""
    try:
        trainer = resolved(TrainerConfig, subs["trainer"], ("ckpt", "interval"))
        orchestrator = resolved(OrchestratorConfig, subs["orchestrator"], ORCHESTRATOR_CKPT_INTERVAL)
    except _Unresolved:
        return
    if trainer is None:
        return
    if orchestrator is None:
        put(subs["orchestrator"], ORCHESTRATOR_CKPT_INTERVAL, trainer)
    elif trainer % orchestrator:
        raise ValueError(
            f"orchestrator.data.ckpt.interval = {orchestrator} does not divide trainer.ckpt.interval = "
            f"{trainer}: a restart resumes both at the trainer's checkpoint, so the orchestrator must "
            "checkpoint there too; leave orchestrator.data.ckpt.interval unset (rl copies the trainer's)"
        )


def _derive_from_k(data: dict[str, Any], subs: dict[str, dict]) -> None:
    """What K decides where features meet (`interactions.py`): the LoRA adapter slots of the engines
    `rl` launches, and the broadcasts a deterministic trainer keeps."""
    try:
        k = resolved(OrchestratorConfig, subs["orchestrator"], ("max_off_policy_steps",))
        interval = resolved(OrchestratorConfig, subs["orchestrator"], ("weights", "update_interval"))
        deterministic = resolved(OrchestratorConfig, subs["orchestrator"], ("deterministic",))
    except _Unresolved:
        return
    derive_lora_slots(subs["inference"], data.get("lora"), k=k, interval=interval)
    derive_keep_last(subs["trainer"], deterministic=deterministic, k=k)
    if isinstance(data.get("eval_inference"), dict):
        data["eval_inference"] = dict(data["eval_inference"])
        derive_lora_slots(data["eval_inference"], data.get("lora"), k=k, interval=interval)


def _propagate_eval_inference(cls: type[BaseModel], data: dict[str, Any]) -> None:
    """Shared fields into `eval_inference`, its engine URLs into `orchestrator.eval.base_urls`."""
    sub = data.get("eval_inference")
    if not isinstance(sub, dict):
        return
    sub = data["eval_inference"] = dict(sub)
    for name in SHARED_FIELDS:
        try:
            value = resolved(cls, data, (name,))
        except _Unresolved:
            continue
        _assign(InferenceConfig, sub, (name,), value, target=f"eval_inference.{name}", source=name)
    orchestrator = data["orchestrator"]
    placement = lookup(orchestrator, ("eval", "placement"))[1]
    if placement != "dedicated":
        raise ValueError(
            f"eval_inference: rl launches eval engines only for orchestrator.eval.placement = 'dedicated' "
            f"(got {placement or 'shared'!r}); set the placement or remove [eval_inference]"
        )
    try:
        urls = engine_urls(sub)
    except _Unresolved:
        return
    _assign(OrchestratorConfig, orchestrator, ("eval", "base_urls"), urls,
            target="orchestrator.eval.base_urls", source="eval_inference.server.host/port")  # fmt: skip


def _propagate_teacher_inference(cls: type[BaseModel], data: dict[str, Any]) -> None:
    """`orchestrator.teacher.model` without URLs: rl serves it itself (`teacher_inference`, shared fields
    but the model copied in), and the engine's URLs become `orchestrator.teacher.base_urls`."""
    teacher = lookup(data["orchestrator"], ("teacher",))[1]
    sub = data.get("teacher_inference")
    if not isinstance(teacher, dict) or teacher.get("model") is None or teacher.get("base_urls"):
        if sub is not None:
            raise ValueError(
                "teacher_inference: rl starts a teacher engine only for orchestrator.teacher.model "
                "(without orchestrator.teacher.base_urls); set the model or remove [teacher_inference]"
            )
        return
    sub = data["teacher_inference"] = dict(sub or {})
    sub.setdefault("server", {})
    sub["server"] = {"port": 0, **sub["server"]}
    for name in TEACHER_SHARED_FIELDS:
        try:
            value = resolved(cls, data, (name,))
        except _Unresolved:
            continue
        _assign(InferenceConfig, sub, (name,), value, target=f"teacher_inference.{name}", source=name)
    _assign(InferenceConfig, sub, ("model", "path"), teacher["model"], target="teacher_inference.model.path",
            source="orchestrator.teacher.model")  # fmt: skip
    try:
        urls = engine_urls(sub)
    except _Unresolved:
        return
    data["orchestrator"] = dict(data["orchestrator"])
    data["orchestrator"]["teacher"] = {**teacher, "base_urls": urls}


def _inf(inference: dict[str, Any], path: KeyPath) -> Any:
    return resolved(InferenceConfig, inference, path)


def engine_urls(inference: dict[str, Any]) -> list[str]:
    """Base URLs of the engines `inference` serves: one, or `sglang.num_engines` on consecutive ports."""
    host = _inf(inference, ("server", "host"))
    port = _inf(inference, ("server", "port"))
    engines = _inf(inference, ("sglang", "num_engines")) if _inf(inference, ("backend",)) == "sglang" else 1
    if host in _UNSPECIFIED_HOSTS:  # bound to every interface: reach it over loopback
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    if _is_ipv6(host):
        host = f"[{host}]"
    return [f"http://{host}:{port + i}" for i in range(engines)]


def engine_capacity(inference: dict[str, Any]) -> int | None:
    """Requests one engine runs at once, when the inference config fixes it (SGLang may choose itself)."""
    if _inf(inference, ("backend",)) == "sglang":
        return _inf(inference, ("sglang", "max_running_requests"))
    return _inf(inference, ("engine", "max_running_requests"))


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def _assign(
    target_cls: type[BaseModel], raw: dict[str, Any], path: KeyPath, value: Any, *, target: str, source: str
) -> None:
    """Set `raw[path] = value` unless the schema lacks the key; an explicit different value is an error."""
    info = _field(target_cls, path)
    if info is None:
        return
    present, explicit = lookup(raw, path)
    if present:
        try:
            explicit_value = _adapter(info).validate_python(explicit)
        except ValidationError:
            return  # keep the invalid value: pydantic names it precisely
        conflict = _first_conflict(explicit, explicit_value, value)
        if conflict is not None:
            sub, mine, theirs = conflict
            raise ValueError(
                f"{target}{sub} = {mine!r} conflicts with {source}{sub} = {theirs!r}: rl copies {source} "
                f"into {target}, so set only {source}{sub}"
            )
    put(raw, path, value.model_dump() if isinstance(value, BaseModel) else value)


def _first_conflict(
    explicit_raw: Any, explicit: Any, value: Any, sub: str = ""
) -> tuple[str, Any, Any] | None:
    """(sub-key, explicit, propagated) of the first explicitly given leaf that differs, or None."""
    if isinstance(explicit, BaseModel) and isinstance(value, BaseModel) and isinstance(explicit_raw, dict):
        for key, raw_item in explicit_raw.items():
            found = _first_conflict(raw_item, getattr(explicit, key), getattr(value, key), f"{sub}.{key}")
            if found is not None:
                return found
        return None
    return None if explicit == value else (sub, _plain(explicit), _plain(value))


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value
