"""Keys that moved into a section: given at their old place, each is refused with one line naming its
new key.

The schemas with moved keys (`OrchestratorConfig`, `TrainerConfig`) call `refuse_moved` from a
before-validator with their `MOVED_KEYS` table (old top-level key -> its dotted key now), so a Python
caller or a raw dict gets `max_buffered_groups moved to admission.max_buffered_groups`; for config files
and flags the loader's "did you mean" names the same new key first.

Invariant: a moved key is never accepted at its old place, and the error names every moved key given
with its full new key, in one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def refuse_moved(data: Any, moved: Mapping[str, str], owner: str) -> Any:
    """`data` unchanged, or a ValueError naming each key of `moved` that `data` (a raw dict) gives."""
    if not isinstance(data, dict):
        return data
    given = {key: new for key, new in moved.items() if key in data}
    if given:
        raise ValueError(
            "; ".join(f"{key} moved to {new}" for key, new in given.items())
            + f" (the {owner}'s settings are grouped in sections, docs/configuration.md)"
        )
    return data
