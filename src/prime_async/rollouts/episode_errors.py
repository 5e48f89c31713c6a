"""Episode errors made visible: each distinct error is logged once, counted, and summarised.

Called by the dispatcher for every finished episode (`record`); its `summary()` is appended to the
run's fatal errors (dropped-groups limit, every early episode failed) so the user sees the cause.

Invariants:
- an error's identity is (kind, first line of its message); kind is "teacher" for a scoring failure of
  the distillation teacher (`metrics["teacher_error"]`, `rollouts/teacher.py`), else
  `Episode.metrics["env_error"]` (see `rollouts/episode.EnvErrorKind`), else the episode's status;
- the first episode with a given identity is logged at WARNING with the full message and the running
  count of that kind; later ones at DEBUG only, so a run of identical failures logs one line;
- `counts_by_kind()` are cumulative since start (the `env/errors/<kind>` metrics);
- `user_frame` names where an exception of the user's code was raised: the innermost frame of the root
  cause (the first traceback of a chain) outside the standard library, verifiers and its libraries, and
  prime_async; `rollouts/episode.py` appends it to the error (`[at path:line in fn]`), so the one-line
  summary says where a reward or an env raised without `--log.level DEBUG`.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
import sysconfig
from collections import Counter

from prime_async.rollouts.types import Episode

logger = logging.getLogger(__name__)

MAX_EXAMPLE_CHARS = 1000
TEACHER = "teacher"  # the kind of a teacher scoring failure: the teacher failed, not the environment


class EpisodesFailing(ValueError):
    """Every early episode failed: the environment (or the teacher) cannot run as configured. A
    ValueError, so the entrypoint reports it as one line (a configuration error), like a bad env key."""


_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<fn>.+)$', re.MULTILINE)
_CHAIN = "Traceback (most recent call last):"
# packages whose frames are the machinery around the user's code, never the place it raised
_FRAMEWORK = (
    "prime_async", "verifiers", "renderers", "pydantic", "pydantic_core", "openai", "httpx", "httpcore",
    "anyio", "mcp", "starlette", "fastapi", "uvicorn", "transformers", "torch",
)  # fmt: skip


@functools.cache
def _framework_dirs() -> tuple[str, ...]:
    """Directories of the standard library and the `_FRAMEWORK` packages (found without importing)."""
    dirs = [sysconfig.get_paths()["stdlib"]]
    for name in _FRAMEWORK:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        dirs.extend((spec.submodule_search_locations or []) if spec else [])
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


def _is_user(path: str) -> bool:
    if path.startswith("<"):  # <frozen ...>, <string>, exec'd sources
        return False
    real = os.path.realpath(path)
    if "site-packages" not in real and "dist-packages" not in real:
        return not real.startswith(_framework_dirs()[0])
    return not real.startswith(_framework_dirs()[1:])


def user_frame(traceback_text: str | None) -> str | None:
    """`path:line in fn` of the innermost frame in user code of the root cause in `traceback_text` (a
    formatted traceback, chained causes first), the path relative to the working directory when under
    it; None when no frame is the user's (or there is no traceback)."""
    for section in (traceback_text or "").split(_CHAIN)[1:]:
        frames = [m for m in _FRAME.finditer(section) if _is_user(m["path"])]
        if frames:
            path, line, fn = frames[-1]["path"], frames[-1]["line"], frames[-1]["fn"].strip()
            rel = os.path.relpath(path) if os.path.realpath(path).startswith(os.getcwd() + os.sep) else path
            return f"{rel}:{line} in {fn}"
    return None


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0][:300] if message.strip() else "(no message)"


class EpisodeErrors:
    """Counts of failed episodes by (kind, first message line), with one example message each."""

    def __init__(self) -> None:
        self._by_error: Counter[tuple[str, str]] = Counter()
        self._by_kind: Counter[str] = Counter()
        self._example: dict[tuple[str, str], str] = {}

    def record(self, episode: Episode) -> None:
        """Count `episode` if it failed ("error" or "aborted"); log a new error once at WARNING."""
        if episode.status not in ("error", "aborted"):
            return
        kind = (
            TEACHER
            if episode.metrics.get("teacher_error")
            else str(episode.metrics.get("env_error") or episode.status)
        )
        message = episode.error or "(no message)"
        key = (kind, _first_line(message))
        self._by_error[key] += 1
        self._by_kind[kind] += 1
        if key not in self._example:
            self._example[key] = message[:MAX_EXAMPLE_CHARS]
            logger.warning(
                "episode error [%s] (new; %d %s error(s) so far) on example %d: %s",
                kind, self._by_kind[kind], kind, episode.example_id, message[:MAX_EXAMPLE_CHARS],
            )  # fmt: skip
        else:
            logger.debug("episode error [%s] x%d: %s", kind, self._by_error[key], key[1])

    @property
    def total(self) -> int:
        return sum(self._by_kind.values())

    def counts_by_kind(self) -> dict[str, int]:
        return dict(self._by_kind)

    def top_kind(self) -> str | None:
        """The kind of the most frequent error (None before any)."""
        return self._by_error.most_common(1)[0][0][0] if self._by_error else None

    def summary(self) -> str | None:
        """'most frequent episode error: ...' with its count and one example message, or None."""
        if not self._by_error:
            return None
        (kind, _line), count = self._by_error.most_common(1)[0]
        example = self._example[(kind, _line)].replace("\n", " | ")
        return f"most frequent episode error ({count} of {self.total} failed episodes): [{kind}] {example}"
