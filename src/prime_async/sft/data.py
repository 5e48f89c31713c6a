"""SFT examples: chats read from JSONL/Parquet files, or built from a verifiers taskset's reference answers.

An example is `Chat(messages, tools)`: `messages` a list of {role, content} dicts as chat templates take
them, `tools` the JSON tool schemas the template renders (or None).

Invariants: the order is the files' order (or the taskset's `load()` order), so example i is the same
every run; a row without a `messages` list, or a message without `role`, raises ValueError naming the
file and row; a taskset without the answer field raises naming the field and the fields it has.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prime_async.config.sft import SFTDataConfig, SFTTasksetConfig


@dataclass(frozen=True)
class Chat:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


def load_chats(cfg: SFTDataConfig) -> list[Chat]:
    """Every example of the configured source, in order."""
    if cfg.env is not None:
        return taskset_chats(cfg.env)
    chats: list[Chat] = []
    for path in cfg.files:
        chats.extend(_file_chats(path))
    if not chats:
        raise ValueError(f"data.files: no examples in {[str(p) for p in cfg.files]}")
    return chats


def _file_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ValueError(f"data.files: {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"data.files: {path}:{n}: not JSON ({e.msg})") from None
    return rows


def _file_chats(path: Path) -> list[Chat]:
    chats = []
    for n, row in enumerate(_file_rows(path), start=1):
        messages = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"data.files: {path} row {n}: needs a non-empty `messages` list")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"data.files: {path} row {n}: every message needs a `role`")
        tools = row.get("tools")
        if isinstance(tools, str):  # Parquet files often store the schemas as one JSON string
            tools = json.loads(tools)
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]  # Parquet fills nulls
        chats.append(Chat(messages=messages, tools=tools))
    return chats


def taskset_chats(cfg: SFTTasksetConfig) -> list[Chat]:
    """[system prompt], the task's prompt, and `str(task.data.<answer_field>)` as the assistant's answer."""
    import verifiers.v1 as vf

    from prime_async.config.env import EnvBaseConfig
    from prime_async.rollouts.verifiers_config import resolve_verifiers_config

    env = vf.load_environment(resolve_verifiers_config(EnvBaseConfig(id=cfg.id, args=cfg.args)))
    if not env.taskset.bounded:
        raise ValueError(f"data.env.id {cfg.id!r} is an infinite taskset: sft needs a finite one")
    chats = []
    for task in env.taskset:
        data = task.data
        if not hasattr(data, cfg.answer_field):
            fields = sorted(type(data).model_fields)
            raise ValueError(f"data.env.answer_field {cfg.answer_field!r}: {cfg.id!r} tasks have {fields}")
        prompt = data.prompt
        messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages.extend(m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in prompt)
        messages.append({"role": "assistant", "content": str(getattr(data, cfg.answer_field))})
        chats.append(Chat(messages=messages))
    if not chats:
        raise ValueError(f"data.env.id {cfg.id!r} loaded no tasks; check data.env.args")
    return chats
