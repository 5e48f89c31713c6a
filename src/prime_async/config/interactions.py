"""Where features meet: the combinations of options that cannot train together, refused at start.

Every option joins the feature-interaction matrix (`tests/matrix/`, its table in
`docs/feature-matrix.md`): a combination either trains, or is refused here, before anything starts, with
one line that names both keys and the reason (a ValueError: the CLI prints it and exits 2). A refusal is
for combinations whose semantics cannot hold together; a combination that should work but does not is
a defect to fix, not a rule to add here.

Who calls it: `RLConfig` (rules across components, and the defaults `rl` derives from them, e.g. the LoRA
adapter slots from K). Rules within the orchestrator's own keys are its validators (`orchestrator.py`).

Invariants:
- each rule is a pure function of validated config values; none imports torch;
- every message starts with the first key as written in TOML, names the second, and says the way out.
"""

from __future__ import annotations

from typing import Any, Protocol

from prime_async.config import placement
from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.config.placement import SHARED_ENGINE_FRACTION, SHARED_TRAINER_FRACTION
from prime_async.config.placement import RunSections as PlacedRun
from prime_async.config.shared import LoraConfig, ModelConfig
from prime_async.config.trainer import DEFAULT_KEEP_LAST


class RestartSettings(Protocol):
    max_restarts: int


class RunSections(PlacedRun, Protocol):
    """What the rules read of an `rl` config (`RLConfig` has it; this module sits below `rl.py`, which
    calls `check_rl` from its validator)."""

    orchestrator: OrchestratorConfig
    deterministic: bool
    lora: LoraConfig | None
    router_replay: bool
    model: ModelConfig
    restart: RestartSettings


def lora_slots_needed(max_off_policy_steps: int, update_interval: int) -> int:
    """Adapter slots an engine needs in a LoRA run.

    A request keeps the adapter of the version it started at through pauses (SGLang fixes it at creation,
    `retract` and `in_place` alike). When version v loads, groups dispatched before v - K were cancelled
    (they cannot ship), so running requests name loaded versions in [v - K, v - 1], spaced
    `weights.update_interval` apart: at most K // interval of them besides v - 1... v itself makes
    K // interval + 1 (`LoraEngineClient` unloads idle adapters before each load). One more slot covers
    the requests of cancelled groups that the engine is still finishing (an abort is asynchronous)."""
    return max_off_policy_steps // update_interval + 2


def derive_lora_slots(inference: dict[str, Any], lora: Any, *, k: int, interval: int) -> None:
    """`rl`: fill `inference.max_loaded_loras` (raw section, before validation) with the slots a LoRA run
    needs at `max_off_policy_steps = k`, when the run trains LoRA and the key is unset."""
    if lora is not None and "max_loaded_loras" not in inference:
        inference["max_loaded_loras"] = lora_slots_needed(k, interval)


def keep_last_needed(max_off_policy_steps: int) -> int:
    """Broadcasts a deterministic trainer keeps: every version is loaded in turn and the trainer runs up
    to K + 1 versions ahead of the served one."""
    return max(DEFAULT_KEEP_LAST, max_off_policy_steps + 1)


def derive_keep_last(trainer: dict[str, Any], *, deterministic: bool, k: int) -> None:
    """`rl`: fill `trainer.weights.keep_last` (raw section) with `keep_last_needed(k)` in a deterministic
    run when it is unset (an explicit smaller value is refused by `check_rl`)."""
    weights = trainer.get("weights")
    if not deterministic or (isinstance(weights, dict) and "keep_last" in weights):
        return
    if keep_last_needed(k) > DEFAULT_KEEP_LAST:
        trainer["weights"] = {
            **(weights if isinstance(weights, dict) else {}),
            "keep_last": keep_last_needed(k),
        }


def check_rl(cfg: RunSections) -> None:
    """Rules across components of one `rl` run (raise ValueError with one line)."""
    orch = cfg.orchestrator
    k, keep = orch.max_off_policy_steps, cfg.trainer.weights.keep_last
    if cfg.deterministic and keep < k + 1:
        raise ValueError(
            f"deterministic = true loads every weight version in turn: trainer.weights.keep_last ({keep}) "
            f"must be >= orchestrator.max_off_policy_steps + 1 ({k + 1})"
        )
    if cfg.lora is not None:
        _check_lora(cfg)
    if cfg.router_replay:
        _check_router_replay(cfg)
    if cfg.weights.transport == "shared":
        _check_shared_weights(cfg)
    placement.check_config(cfg)  # the explicit [gpus] lists; the machine's devices are checked at start


def _check_router_replay(cfg: RunSections) -> None:
    if cfg.lora is not None:
        raise ValueError(
            "router_replay = true with lora: the embedded engine serves no LoRA adapters on MoE models; "
            "train the MoE model in full, or set router_replay = false"
        )
    if cfg.model.build in ("tiny", "tiny_vlm", "smollm2"):
        raise ValueError(
            f"router_replay = true with model.build = '{cfg.model.build}': a dense model has no routing to "
            "replay; use an MoE model (e.g. model.build = 'tiny_moe') or set router_replay = false"
        )
    from prime_async.config.megatron import find_hf_config, num_experts

    hf = find_hf_config(cfg.model.path)
    if hf is not None and not num_experts(hf):
        raise ValueError(
            f"router_replay = true with model.path = {cfg.model.path} ({hf.get('model_type')}, dense): "
            "there is no routing to replay; use an MoE model (Qwen3-MoE family) or set router_replay = false"
        )


def _check_lora(cfg: RunSections) -> None:
    orch = cfg.orchestrator
    lora = cfg.lora
    assert lora is not None
    if lora.modules_to_save:
        raise ValueError(
            f"lora.modules_to_save = {lora.modules_to_save}: the inference engines serve adapters "
            "of linear layers only; train those modules in full without LoRA, or leave it empty"
        )
    if cfg.restart.max_restarts > 0:
        raise ValueError(
            "restart.max_restarts > 0 with lora: restarting a component does not reload adapters yet; "
            "set restart.max_restarts = 0 (with lora, a component that dies or a planned stop of the "
            "orchestrator ends the run: `rl` cannot resume a run)"
        )
    if cfg.weights.transport != "filesystem":
        raise ValueError(
            f"lora with weights.transport = '{cfg.weights.transport}': adapters travel as PEFT directories "
            "on the filesystem only; set weights.transport = 'filesystem'"
        )
    needed = lora_slots_needed(orch.max_off_policy_steps, orch.weights.update_interval)
    engines = [("inference", cfg.inference)]
    if cfg.eval_inference is not None:
        engines.append(("eval_inference", cfg.eval_inference))
    for section, inference in engines:
        if inference.max_loaded_loras < needed:
            raise ValueError(
                f"{section}.max_loaded_loras = {inference.max_loaded_loras} with lora and "
                f"orchestrator.max_off_policy_steps = {orch.max_off_policy_steps}: requests keep their "
                f"version's adapter through pauses, so up to K // weights.update_interval + 2 = {needed} "
                f"adapters are loaded at once; raise {section}.max_loaded_loras or leave it unset (rl "
                "derives it from K)"
            )


def _check_shared_weights(cfg: RunSections) -> None:
    """`weights.transport = "shared"`: the embedded engine only, and each side's stated device share."""
    if cfg.inference.backend == "sglang":
        raise ValueError(
            "weights.transport = 'shared' with inference.backend = 'sglang': SGLang's "
            "/update_weights_from_tensor takes pickled tensors, which this project never sends; use "
            "the embedded engine (backend = 'torch'), or weights.transport = 'filesystem' with SGLang"
        )
    trainer, engine = cfg.trainer.runtime.mem_fraction, cfg.inference.engine.mem_fraction
    if trainer is None or engine is None:
        raise ValueError(
            f"weights.transport = 'shared' with trainer.runtime.mem_fraction = {trainer} and "
            f"inference.engine.mem_fraction = {engine}: trainer and engine share one device, state each "
            f"share (e.g. {SHARED_TRAINER_FRACTION} and {SHARED_ENGINE_FRACTION})"
        )
    if trainer + engine > 1:
        raise ValueError(
            f"trainer.runtime.mem_fraction = {trainer} with inference.engine.mem_fraction = {engine}: they "
            f"share one device (weights.transport = 'shared') and their sum {trainer + engine:g} exceeds 1; "
            "lower them"
        )
