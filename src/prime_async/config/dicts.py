"""Nested dicts of config data (TOML tables, CLI overrides): the one deep merge and the one key-path
lookup and assignment, used by the loader, `rl`'s propagation, restarts and verifiers env configs.

Invariants: `deep_merge` never mutates its arguments (tables merge key by key, anything else, lists
included, replaces); `put` copies every table on its path before writing, so a dict shared with another
config is never changed through it.
"""

from __future__ import annotations

from typing import Any

KeyPath = tuple[str, ...]


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """A new dict: `base` with `override` merged in (tables key by key, anything else replaces)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def lookup(data: dict[str, Any], path: KeyPath) -> tuple[bool, Any]:
    """`(True, value)` at `path` (e.g. `("orchestrator", "eval", "placement")`), else `(False, None)`."""
    node: Any = data
    for segment in path:
        if not isinstance(node, dict) or segment not in node:
            return False, None
        node = node[segment]
    return True, node


def put(data: dict[str, Any], path: KeyPath, value: Any) -> None:
    """Set `value` at `path` in `data`, creating (or copying) the tables on the way."""
    node = data
    for segment in path[:-1]:
        child = node.get(segment)
        node[segment] = child = dict(child) if isinstance(child, dict) else {}
        node = child
    node[path[-1]] = value
