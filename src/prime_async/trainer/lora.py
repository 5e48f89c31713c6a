"""LoRA adapters on the FSDP backend (`trainer.lora`), with PEFT.

    HF model ──get_peft_model──► adapters injected in place (q_proj -> lora.Linear(base_layer, lora_A/B))
                                 base weights frozen; the backend trains the same HF module object
    adapter_tensors(model) ──► {"base_model.model.<name>.lora_A.weight": ...}  (PEFT's file naming)

Used by `trainer/fsdp.py` (inject, publish, checkpoint) and `weights/writer.py` (adapter broadcasts).

Invariants:
- after `apply_lora` exactly the adapter parameters (and `modules_to_save` copies) require grad; the
  optimizer is built over parameters that require grad only, so base weights have no optimizer state;
- `adapter_tensors` is collective under FSDP2 (every rank gathers the same parameters in the same
  order) and returns full, unsharded CPU tensors named as PEFT's `save_pretrained` names them, so a
  published directory loads with `PeftModel.from_pretrained` and SGLang's `/load_lora_adapter`;
- the adapter's update is `(alpha / rank) * B A x` (no rsLoRA, no DoRA): what the engines apply;
- a vision-language model's vision tower gets no adapter (`VISION_MODULES` excluded): the language model
  trains, images are encoded by the base tower on both sides.
"""

from __future__ import annotations

import torch

from prime_async.config.shared import LoraConfig
from prime_async.trainer.vision import is_vision_language

ADAPTER_NAME = "default"
VISION_MODULES = r".*\bvisual\..*"  # PEFT regex (full match) of a VLM's vision tower modules
PEFT_PREFIX = "base_model.model."


def peft_config(cfg: LoraConfig, base_model_path: str):
    """The PEFT `LoraConfig` of `cfg` (what `adapter_config.json` holds)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        # a vision-language model: adapters on the language model only (the vision tower stays as it is)
        exclude_modules=VISION_MODULES if is_vision_language(base_model_path) else None,
        modules_to_save=list(cfg.modules_to_save) or None,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_path,
    )


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, base_model_path: str):
    """Inject adapters into `model` in place (base frozen); returns the `PeftModel` wrapping it.

    Raises ValueError naming the patterns when `target_modules` matches no linear layer."""
    from peft import get_peft_model

    try:
        peft_model = get_peft_model(model, peft_config(cfg, base_model_path), adapter_name=ADAPTER_NAME)
    except ValueError as exc:  # PEFT: "Target modules {...} not found in the base model"
        raise ValueError(f"lora.target_modules = {cfg.target_modules}: {exc}") from exc
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"lora.target_modules = {cfg.target_modules} left no trainable parameter")
    return peft_model


def _full(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "full_tensor"):  # an FSDP2 DTensor shard: all-gather (collective)
        t = t.full_tensor()
    return t.detach().to("cpu").contiguous()


def peft_file_name(name: str) -> str:
    """HF-module parameter name -> PEFT adapter-file key (adapter name dropped, PEFT prefix added)."""
    name = name.replace(f".lora_A.{ADAPTER_NAME}.", ".lora_A.").replace(
        f".lora_B.{ADAPTER_NAME}.", ".lora_B."
    )
    name = name.replace(f".modules_to_save.{ADAPTER_NAME}.", ".")
    return PEFT_PREFIX + name


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trained adapter as full CPU tensors in PEFT's file naming (collective under FSDP2)."""
    return {peft_file_name(n): _full(p) for n, p in model.named_parameters() if p.requires_grad}
