"""Which `renderers` renderer turns an episode's chat into token ids: chosen from the model.

Who calls it: `rollouts/verifiers_source.py` at `start()`, before any episode. `env.renderer` with a `name`
other than "auto" is used as given (the user's override). Otherwise the renderer is the one verifiers'
`renderers` package maps the model's canonical name to (`MODEL_RENDERER_MAP`, e.g. `Qwen/Qwen3-8B` ->
`qwen3`); a local checkpoint is matched by its `config.json` `model_type` when its tokenizer carries that
family's special tokens (a Qwen3 checkpoint with `<tool_call>` ... -> `qwen3`); anything else gets
`default` (the tokenizer's own chat template).

Invariants: pure reads of the model directory (no network, no tokenizer load); a tool environment
with a renderer that cannot parse tool calls is refused with one line naming the model and the env.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# model_type -> (renderer, special tokens the tokenizer must carry for that renderer)
_QWEN3_TOKENS = ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</think>")
_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
_FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "qwen3": ("qwen3", _QWEN3_TOKENS),
    "qwen3_moe": ("qwen3", _QWEN3_TOKENS),  # the same chat template and tool format as the dense models
    # Qwen2.5-VL / Qwen3-VL checkpoints (the tiny VLM): ChatML, <|vision_start|><|image_pad|><|vision_end|>
    # per image, expanded by the engine (`rollouts/images.py`)
    "qwen2_5_vl": ("qwen3-vl", (*_QWEN3_TOKENS, *_VISION_TOKENS)),
    "qwen3_vl": ("qwen3-vl", (*_QWEN3_TOKENS, *_VISION_TOKENS)),
}


def _tokenizer_tokens(model_dir: Path) -> set[str]:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return set()
    data = json.loads(path.read_text())
    tokens = {t["content"] for t in data.get("added_tokens", [])}
    vocab = data.get("model", {}).get("vocab", {})
    return tokens | (set(vocab) if isinstance(vocab, dict) else set())


def renderer_for_model(model_path: str) -> str:
    """The renderer name for `model_path` (an HF id or a local checkpoint directory)."""
    from renderers.base import MODEL_RENDERER_MAP

    if model_path in MODEL_RENDERER_MAP:
        return MODEL_RENDERER_MAP[model_path]
    model_dir = Path(model_path)
    config = model_dir / "config.json"
    if not config.is_file():
        return "default"
    model_type = json.loads(config.read_text()).get("model_type", "")
    family = _FAMILIES.get(model_type)
    if family is None:
        return "default"
    name, required = family
    return name if set(required) <= _tokenizer_tokens(model_dir) else "default"


def choose_renderer(requested: dict[str, Any], model_path: str) -> dict[str, Any]:
    """`env.renderer` resolved: an explicit name wins, else the model's renderer (other keys kept)."""
    if requested.get("name", "auto") != "auto":
        return dict(requested)
    return {**requested, "name": renderer_for_model(model_path)}


def renderer_supports_tools(renderer: dict[str, Any]) -> bool:
    """Whether the renderer parses tool calls out of sampled text (`default` only with a tool_parser)."""
    return renderer.get("name") != "default" or bool(renderer.get("tool_parser"))


def env_uses_tools(env: Any) -> bool:
    """Whether a loaded verifiers env serves MCP tools (task-scoped or taskset-scoped toolsets)."""
    taskset = env.taskset
    task_cls = type(taskset).task_type()
    return bool(task_cls.toolsets(taskset.config.task)) or bool(taskset.toolsets(taskset.config))


def check_tools_renderer(env: Any, env_id: str, renderer: dict[str, Any], model_path: str) -> None:
    """Refuse a tool environment whose renderer cannot parse the model's tool calls (one line)."""
    if env_uses_tools(env) and not renderer_supports_tools(renderer):
        raise ValueError(
            f"env.id {env_id!r} uses MCP tools but model {model_path!r} has no tool-capable renderer "
            f'(resolved {renderer.get("name")!r}); set env.renderer = {{name = "qwen3"}} (or the model\'s '
            "family), or a default renderer with a tool_parser"
        )
