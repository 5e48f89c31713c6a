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
- a scoring failure (engine error, timeout, an answer that does not match the tokens sent) turns the
  episode into status "error" with error "teacher: ..." (not trained; the ledger counts it as errored);
- with deterministic = true every episode is its own request: the batch composition would otherwise
  change the teacher's floating-point sums, and with them the advantages.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from prime_async.config.orchestrator import TeacherConfig
from prime_async.engine_api import EngineUnavailable
from prime_async.inference.client import EngineError, HttpEngineClient
from prime_async.rollouts.types import Episode

logger = logging.getLogger(__name__)


class TeacherScorer:
    """Scores finished episodes on the teacher's engines; `window_metrics()` is its cost since last asked."""

    def __init__(self, cfg: TeacherConfig, *, temperature: float, deterministic: bool):
        if not cfg.base_urls:
            raise ValueError(
                "orchestrator.teacher.base_urls is empty: give the teacher's engines (under rl, "
                "orchestrator.teacher.model makes rl start one and fill the URLs)"
            )
        self.cfg, self.temperature = cfg, temperature
        self.batch_episodes = 1 if deterministic else cfg.batch_episodes
        self.clients = [HttpEngineClient(url, cfg.api_key) for url in cfg.base_urls]
        self._next_client = itertools.cycle(self.clients)
        self._slots = asyncio.Semaphore(cfg.max_concurrent_requests)
        self._window = {"requests": 0, "episodes": 0, "tokens": 0, "seconds": 0.0, "errors": 0}

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients))

    async def score(self, episodes: list[Episode]) -> None:
        """Fill `teacher_logprobs` of every ok episode with a loss token (see the module invariants)."""
        todo = [ep for ep in episodes if ep.status == "ok" and any(ep.loss_mask)]
        chunks = [todo[i : i + self.batch_episodes] for i in range(0, len(todo), self.batch_episodes)]
        await asyncio.gather(*(self._score_chunk(chunk) for chunk in chunks))

    async def _score_chunk(self, episodes: list[Episode]) -> None:
        starts = [ep.loss_mask.index(True) for ep in episodes]
        async with self._slots:
            client = next(self._next_client)
            t0 = time.perf_counter()
            try:
                scored = await asyncio.wait_for(
                    client.score([ep.token_ids for ep in episodes], starts, temperature=self.temperature),
                    timeout=self.cfg.timeout_s,
                )
            except (EngineError, EngineUnavailable, TimeoutError) as exc:
                self._fail(episodes, f"{client.base_url}: {type(exc).__name__}: {exc}")
                return
            finally:
                self._window["requests"] += 1
                self._window["seconds"] += time.perf_counter() - t0
        for ep, start, logprobs in zip(episodes, starts, scored, strict=True):
            ep.teacher_logprobs = [0.0] * start + [
                lp if m else 0.0 for lp, m in zip(logprobs, ep.loss_mask[start:], strict=True)
            ]
        self._window["episodes"] += len(episodes)
        self._window["tokens"] += sum(len(lps) for lps in scored)

    def _fail(self, episodes: list[Episode], reason: str) -> None:
        if self._window["errors"] == 0:
            logger.warning("teacher scoring failed for %d episode(s): %s", len(episodes), reason)
        self._window["errors"] += len(episodes)
        for ep in episodes:
            ep.status, ep.error = "error", f"teacher: {reason}"

    def window_metrics(self) -> dict[str, float]:
        """`teacher/*`: requests, episodes and tokens scored, seconds spent in requests (summed over the
        concurrent ones), episodes failed, since the previous call (one training step)."""
        out = {f"teacher/{name}": float(value) for name, value in self._window.items()}
        self._window = dict.fromkeys(self._window, 0)
        self._window["seconds"] = 0.0
        return out
