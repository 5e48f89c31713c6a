"""Memoizes pydantic's "does this default factory take the validated data?" check.

pydantic (2.14) answers that question on every `Model.model_construct()` for every field left unset,
by calling `inspect.signature(factory)`; for builtins such as `list` or `time.time` that parses the
text signature (`ast.parse`), tens of microseconds a field. verifiers builds each episode's trace graph
with `model_construct` (a few message nodes per model call), which made it ~8% of the orchestrator's
CPU on `configs/tiny/rl.toml` (py-spy). The answer depends only on the factory's signature, which does
not change, so `install()` wraps pydantic's function in a cache.

Invariants: the cached answer is pydantic's own answer for the same factory object (a factory that
cannot be hashed goes to pydantic uncached); `install()` is idempotent; a pydantic without the function
is left alone (`install()` returns False, and the speedup is simply absent).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_MARK = "__prime_async_memoized__"
_TARGET = "takes_validated_data_argument"


def install() -> bool:
    """Memoize `pydantic._internal._fields.takes_validated_data_argument`; True when it is in place."""
    try:
        from pydantic._internal import _fields
    except ImportError:
        return False
    original = getattr(_fields, _TARGET, None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True
    setattr(_fields, _TARGET, _memoized(original))
    return True


def _memoized(original: Callable[[Any], bool]) -> Callable[[Any], bool]:
    cached = functools.lru_cache(maxsize=4096)(original)

    @functools.wraps(original)
    def takes_validated_data_argument(default_factory: Any) -> bool:
        try:
            return cached(default_factory)
        except TypeError:  # unhashable factory (lru_cache hashes before calling): ask pydantic directly
            return original(default_factory)

    setattr(takes_validated_data_argument, _MARK, True)
    return takes_validated_data_argument
