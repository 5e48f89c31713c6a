"""On-policy distillation: the teacher's logprob of every sampled token of every finished episode.

    Dispatcher._run_group: episodes done ──TeacherScorer.score(episodes)──► batches of <= batch_episodes
        ──/generate (max_new_tokens = 0, logprob_start_len = first loss token) on the teacher's engines,
          round robin, <= max_concurrent_requests in flight──► ep.teacher_logprobs ──► groups.finish

Who calls it: the dispatcher, for every finished group, before the group is reported finished; the batch
builder carries the logprobs to the trainer (`trainer/opd.py` turns them into the advantage term).

Invariants:
- a group becomes visible to the batch cut only after its episodes are scored, so a cut never waits on
  the teacher: scoring overlaps the generation of the other groups in flight;
- every ok episode with a loss token gets `teacher_logprobs` of len(token_ids): the teacher's logprob of
  each loss token given everything before it (prompt, earlier turns, tool results), 0.0 elsewhere;
- an outage of the teacher (connection refused or reset, no answer within `timeout_s`, HTTP 502/503/504)
  is waited out: the chunk's request is retried with exponential backoff (0.5 s doubling to 10 s) while
  the group stays in flight, so nothing finished is dropped; the outage starts at the first such failure
  and ends at the next answer of any teacher engine; a failure later than `outage_timeout_s` after its
  start raises `TeacherUnavailable` (the run fails in one line naming the teacher and the key);
- any other failure (an HTTP error answer, an answer not in SGLang's shape, tokens that do not match)
  turns the chunk's episodes into status "error" with error "teacher: <url>: ..." and
  `metrics["teacher_error"] = True`; `score` returns them so the dispatcher counts them as teacher errors
  (`rollouts/episode_errors.py`); they are not trained (the ledger counts them as errored);
- while an outage lasts, `outage_line()` names the teacher (the orchestrator's batch wait reports it as
  what the run waits on, `utils/stall.py`) and `describe()` is its part of `stall.json`;
- with deterministic = true every episode is its own request: the batch composition would otherwise
  change the teacher's floating-point sums, and with them the advantages.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from prime_async.config.orchestrator import TeacherConfig
from prime_async.engine_api import EngineUnavailable
from prime_async.inference.client import EngineError, HttpEngineClient
from prime_async.rollouts.types import Episode

logger = logging.getLogger(__name__)

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 10.0
OUTAGE_STATUSES = frozenset({502, 503, 504})  # a proxy or a server on its way up: down, not wrong


class TeacherUnavailable(ValueError):
    """The teacher did not answer for longer than `orchestrator.teacher.outage_timeout_s`. A ValueError,
    so the entrypoint reports it as one line (like `EpisodesFailing`): the fix is outside the run."""


class _Outage(Exception):
    """One request met an outage (the engine at `url` is unreachable or not ready)."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"{url}: {reason}")


class _Rejected(Exception):
    """One request got an answer that cannot be used: its episodes fail as teacher errors."""


class TeacherScorer:
    """Scores finished episodes on the teacher's engines; `metrics()` is its cost since last asked."""

    def __init__(
        self,
        cfg: TeacherConfig,
        *,
        temperature: float,
        deterministic: bool,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not cfg.base_urls:
            raise ValueError(
                "orchestrator.teacher.base_urls is empty: give the teacher's engines (under rl, "
                "orchestrator.teacher.model makes rl start one and fill the URLs)"
            )
        self.cfg, self.temperature, self.clock = cfg, temperature, clock
        self.batch_episodes = 1 if deterministic else cfg.batch_episodes
        self.clients = [HttpEngineClient(url, cfg.api_key) for url in cfg.base_urls]
        self._next_client = itertools.cycle(self.clients)
        self._slots = asyncio.Semaphore(cfg.max_concurrent_requests)
        self.down_since: float | None = None  # clock() at the first failure of the current outage
        self._last_outage = ""
        self._scoring = 0  # score() calls running: groups waiting for the teacher
        self._window = dict.fromkeys(("requests", "episodes", "tokens", "seconds", "errors", "retries"), 0.0)
        self._window["outage_s"] = 0.0

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients))

    async def score(self, episodes: list[Episode]) -> list[Episode]:
        """Fill `teacher_logprobs` of every ok episode with a loss token (see the module invariants);
        returns the episodes whose scoring failed (now status "error"). Raises TeacherUnavailable when an
        outage outlasts `outage_timeout_s`."""
        todo = [ep for ep in episodes if ep.status == "ok" and any(ep.loss_mask)]
        chunks = [todo[i : i + self.batch_episodes] for i in range(0, len(todo), self.batch_episodes)]
        self._scoring += 1
        try:
            failed = await asyncio.gather(*(self._score_chunk(chunk) for chunk in chunks))
        finally:
            self._scoring -= 1
        return [ep for chunk in failed for ep in chunk]

    async def _score_chunk(self, episodes: list[Episode]) -> list[Episode]:
        """Score one request's episodes, waiting out outages; returns the episodes that failed."""
        starts = [ep.loss_mask.index(True) for ep in episodes]
        delay = BACKOFF_START_S
        while True:
            try:
                scored = await self._request(episodes, starts)
            except _Outage as outage:
                left = self._went_down(str(outage))
                await asyncio.sleep(min(delay, left))
                delay = min(2 * delay, BACKOFF_MAX_S)
                self._window["retries"] += 1
                continue
            except _Rejected as rejected:
                self._came_back()  # it answered: up, but not usable
                return self._fail(episodes, str(rejected))
            self._came_back()
            break
        for ep, start, logprobs in zip(episodes, starts, scored, strict=True):
            ep.teacher_logprobs = [0.0] * start + [
                lp if m else 0.0 for lp, m in zip(logprobs, ep.loss_mask[start:], strict=True)
            ]
        self._window["episodes"] += len(episodes)
        self._window["tokens"] += sum(len(lps) for lps in scored)
        return []

    async def _request(self, episodes: list[Episode], starts: list[int]) -> list[list[float]]:
        """One scoring request; raises _Outage (retry later) or _Rejected (the episodes fail)."""
        async with self._slots:
            client = next(self._next_client)
            t0 = time.perf_counter()
            try:
                images = [[im.url for im in ep.images] for ep in episodes]  # a VLM's: expanded in token_ids
                return await asyncio.wait_for(
                    client.score(
                        [ep.token_ids for ep in episodes], starts, temperature=self.temperature,
                        image_data=images if any(images) else None,
                    ),
                    timeout=self.cfg.timeout_s,
                )  # fmt: skip
            except EngineUnavailable as exc:
                raise _Outage(client.base_url, str(exc)) from exc
            except TimeoutError as exc:
                raise _Outage(
                    client.base_url, f"no answer within timeout_s = {self.cfg.timeout_s:g} s"
                ) from exc
            except EngineError as exc:
                if exc.status in OUTAGE_STATUSES:
                    raise _Outage(client.base_url, f"EngineError: {exc}") from exc
                raise _Rejected(f"{client.base_url}: EngineError: {exc}") from exc
            except ValueError as exc:  # e.g. an episode the scoring request cannot express
                raise _Rejected(f"{client.base_url}: {type(exc).__name__}: {exc}") from exc
            finally:
                self._window["requests"] += 1
                self._window["seconds"] += time.perf_counter() - t0

    def _went_down(self, reason: str) -> float:
        """Record an outage failure; the seconds left before the deadline (TeacherUnavailable past it)."""
        now = self.clock()
        self._last_outage = reason
        if self.down_since is None:
            self.down_since = now
            logger.warning(
                "teacher unreachable (%s): finished groups wait for scoring, retried with backoff for up to "
                "orchestrator.teacher.outage_timeout_s = %g s", reason, self.cfg.outage_timeout_s,
            )  # fmt: skip
        down = now - self.down_since
        if down >= self.cfg.outage_timeout_s:
            raise TeacherUnavailable(
                f"the teacher has not answered for {down:.0f} s (orchestrator.teacher.outage_timeout_s = "
                f"{self.cfg.outage_timeout_s:g}): {reason}; finished groups cannot be scored, so no batch "
                "can be cut"
            )
        return self.cfg.outage_timeout_s - down

    def _came_back(self) -> None:
        if self.down_since is None:
            return
        down = self.clock() - self.down_since
        self.down_since = None
        self._window["outage_s"] += down
        logger.warning("teacher answers again after %.1f s down: scoring resumed", down)

    def _fail(self, episodes: list[Episode], reason: str) -> list[Episode]:
        self._window["errors"] += len(episodes)
        for ep in episodes:
            ep.status, ep.error = "error", f"teacher: {reason}"
            ep.metrics["teacher_error"] = True
        return episodes

    def outage_line(self) -> str | None:
        """What the run waits on while the teacher is down (None while it answers)."""
        if self.down_since is None:
            return None
        return (
            f"the teacher ({', '.join(self.cfg.base_urls)}): unreachable for "
            f"{self.clock() - self.down_since:.0f} s, {self._scoring} finished group(s) wait for scoring "
            f"(orchestrator.teacher.outage_timeout_s = {self.cfg.outage_timeout_s:g}; last error: "
            f"{self._last_outage})"
        )

    def describe(self) -> dict[str, Any]:
        """The teacher's part of a stall report."""
        down = None if self.down_since is None else round(self.clock() - self.down_since, 3)
        return {
            "base_urls": list(self.cfg.base_urls), "down_for_s": down,
            "last_outage": self._last_outage or None, "groups_waiting_for_scoring": self._scoring,
        }  # fmt: skip

    def metrics(self) -> dict[str, float]:
        """`teacher/*`: requests, episodes and tokens scored, seconds spent in requests (summed over the
        concurrent ones), episodes failed (`errors`), requests retried after an outage (`retries`) and
        seconds of the outages that ended (`outage_s`), since the previous call (one training step)."""
        out = {f"teacher/{name}": float(value) for name, value in self._window.items()}
        self._window = dict.fromkeys(self._window, 0.0)
        return out
