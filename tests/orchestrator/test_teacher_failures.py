"""Teacher (on-policy distillation) failures: named as the teacher's, and an outage is waited out.

The audit's reproduction (F4): the real `TeacherScorer` against a closed port or a fake teacher served
over real HTTP (uvicorn in the test's loop), the orchestrator's real loop (admission, dispatcher, group
table, sink) on the project's simulator. Checks:
- an HTTP error answer or a malformed answer fails the episodes as teacher errors, and both fatal lines
  (every early episode failed; the dropped-groups limit) name the teacher, not the environment;
- a teacher that is down holds scoring: finished groups wait (none dropped), requests are retried with
  backoff, the stall report names the teacher, and the run finishes when the teacher comes back, also
  when it dies and comes back mid-run;
- past `orchestrator.teacher.outage_timeout_s` the run fails in one line naming the URL and the key.
The real-process version (the `rl` launcher restarts a SIGKILLed teacher engine) is
tests/reliability/test_teacher_outage.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
from pathlib import Path
from typing import Any

import pytest

from loopback_server import serve_on_port
from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.orchestrator.components import ComponentInputs, build_components
from prime_async.orchestrator.orchestrator import run_loop
from prime_async.rollouts.episode_errors import EpisodesFailing
from prime_async.rollouts.teacher import TeacherScorer, TeacherUnavailable
from prime_async.rollouts.types import Episode
from prime_async.simulation import InMemoryBroadcasts, SimParams, SimulatedEngine, SimulatedRolloutSource
from prime_async.utils.stall import StallWatch
from prime_async.weights.loaders.filesystem import FilesystemLoader


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeTeacher:
    """A teacher engine on 127.0.0.1:`port` answering SGLang's scoring request (logprob -1 per token) or,
    per `mode`, an HTTP 400, a body that is not JSON, or JSON without `meta_info`."""

    def __init__(self, port: int, mode: str = "ok") -> None:
        self.port, self.mode, self.requests = port, mode, 0
        self._server: Any = None
        self._task: asyncio.Task | None = None

    def _app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, PlainTextResponse
        from starlette.routing import Route

        async def generate(request: Any) -> Any:
            self.requests += 1
            body = await request.json()
            if self.mode == "400":
                return PlainTextResponse("token id out of vocabulary", status_code=400)
            if self.mode == "not_json":
                return PlainTextResponse("<html>teacher</html>")
            if self.mode == "no_meta":
                return JSONResponse([{"text": ""} for _ in body["input_ids"]])
            return JSONResponse([
                {"meta_info": {"input_token_logprobs": [[-1.0, t, None] for t in ids[start:]]}}
                for ids, start in zip(body["input_ids"], body["logprob_start_len"], strict=True)
            ])  # fmt: skip

        async def health(_request: Any) -> Any:
            return JSONResponse({"status": "ok"})

        return Starlette(routes=[Route("/generate", generate, methods=["POST"]), Route("/health", health)])

    async def start(self) -> FakeTeacher:
        self._server, self._task = await serve_on_port(self._app(), self.port, "fake teacher")
        return self

    async def stop(self) -> None:
        """Down like a killed engine: the port refuses, open connections are closed."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = self._server.force_exit = True
        task, self._server, self._task = self._task, None, None
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), timeout=10)


def _cfg(tmp: Path, port: int, **extra: Any) -> OrchestratorConfig:
    teacher = {"base_urls": [f"http://127.0.0.1:{port}"], "timeout_s": 5, **extra.pop("teacher", {})}
    return OrchestratorConfig.model_validate({
        "output_dir": str(tmp), "max_steps": 3, "batch_groups": 2, "group_size": 2, "max_off_policy_steps": 3,
        "inference": {"base_urls": ["sim://engine0"]}, "teacher": teacher, **extra,
    })  # fmt: skip


async def _run(
    cfg: OrchestratorConfig, *, stalls: StallWatch | None = None, during: Any = None, latency_s: float = 0.01
) -> dict:
    """The orchestrator's loop on the simulator with the real TeacherScorer; returns the components and
    the metric rows. `during(comps)`: a coroutine run beside the loop (cancelled at its end)."""
    params = SimParams(num_engines=1, latency_s=latency_s, max_latency_s=5 * latency_s)
    rng = random.Random(0)
    engines = [SimulatedEngine(index=0, params=params, rng=rng)]
    sources = {e.label: SimulatedRolloutSource(engines=engines, params=params, rng=rng) for e in cfg.envs}
    teacher = TeacherScorer(cfg.teacher, temperature=1.0, deterministic=False)
    comps = build_components(
        cfg,
        ComponentInputs(
            source=sources,
            engines=engines,
            loader=FilesystemLoader(InMemoryBroadcasts()),
            served_version=0,
            teacher=teacher,
        ),
    )
    rows: list[dict] = []
    side = asyncio.create_task(during(comps)) if during is not None else None

    async def send(_batch: Any) -> None:
        return None

    try:
        await asyncio.wait_for(
            run_loop(
                cfg, comps, send_batch=send, log_metrics=lambda m, s: rows.append(dict(m)), stalls=stalls
            ),
            timeout=60,
        )
    finally:
        if side is not None:
            side.cancel()
            await asyncio.gather(side, return_exceptions=True)
        await teacher.aclose()
    return {"comps": comps, "rows": rows}


# -- failures the teacher answers: teacher errors, named as such --------------------------------------
@pytest.mark.parametrize("mode", ["400", "not_json", "no_meta"])
def test_every_early_episode_failing_on_the_teacher_names_the_teacher(tmp_path: Path, mode: str) -> None:
    async def main() -> None:
        port = _closed_port()
        fake = await FakeTeacher(port, mode).start()
        try:
            with pytest.raises(EpisodesFailing) as info:
                await _run(_cfg(tmp_path, port, admission={"fail_fast_groups": 2}))
        finally:
            await fake.stop()
        msg = str(info.value)
        assert "[teacher] teacher: http://127.0.0.1:" in msg and "the teacher cannot score" in msg, msg
        assert "environment" not in msg and "None" not in msg and "(0 episodes)" not in msg, msg
        if mode != "400":
            assert "malformed scoring answer" in msg, msg

    asyncio.run(main())


def test_the_dropped_groups_limit_names_teacher_failures(tmp_path: Path) -> None:
    async def main() -> None:
        port = _closed_port()
        fake = await FakeTeacher(port, "400").start()
        try:
            with pytest.raises(RuntimeError) as info:
                await _run(_cfg(tmp_path, port, admission={"fail_fast_groups": 0}))
        finally:
            await fake.stop()
        msg = str(info.value)
        assert "groups dropped since the last batch cut" in msg and "last reason: errored" in msg, msg
        assert "the drops are teacher failures" in msg and "[teacher]" in msg and "HTTP 400" in msg, msg
        assert "check rewards/filters" not in msg, msg

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["400", "not_json", "no_meta"])
def test_a_teacher_answer_that_cannot_be_used_fails_its_episodes_not_the_run(
    tmp_path: Path, mode: str
) -> None:
    """TeacherScorer alone: the episodes come back failed, marked as teacher errors; nothing raises."""

    async def main() -> None:
        port = _closed_port()
        fake = await FakeTeacher(port, mode).start()
        cfg = _cfg(tmp_path, port).teacher
        scorer = TeacherScorer(cfg, temperature=1.0, deterministic=False)
        episodes = [
            Episode(example_id=i, token_ids=[1, 2, 3, 4], loss_mask=[False, False, True, True], status="ok")
            for i in range(3)
        ]
        try:
            failed = await scorer.score(episodes)
        finally:
            await scorer.aclose()
            await fake.stop()
        assert failed == episodes and all(ep.status == "error" for ep in episodes)
        assert all(
            ep.metrics["teacher_error"] and ep.error.startswith(f"teacher: {cfg.base_urls[0]}")
            for ep in episodes
        )
        assert scorer.metrics()["teacher/errors"] == 3.0

    asyncio.run(main())


# -- outages: held, retried, reported, survived --------------------------------------------------------
@pytest.mark.parametrize("fail_fast_groups", [2, 0])
def test_a_teacher_down_past_the_deadline_fails_in_one_line(tmp_path: Path, fail_fast_groups: int) -> None:
    """The audit's case: the teacher on a closed port. Groups wait for it (none dropped) until
    outage_timeout_s, then the run fails naming the teacher's URL and the key."""

    async def main() -> None:
        port = _closed_port()
        admission = {"fail_fast_groups": fail_fast_groups}
        cfg = _cfg(tmp_path, port, admission=admission, teacher={"outage_timeout_s": 1.5})
        seen: dict = {}

        async def watch(comps: Any) -> None:
            seen["comps"] = comps

        with pytest.raises(TeacherUnavailable) as info:
            await _run(cfg, during=watch)
        msg = str(info.value)
        assert f"http://127.0.0.1:{port}" in msg and "orchestrator.teacher.outage_timeout_s = 1.5" in msg, msg
        assert "the teacher has not answered for" in msg and "\n" not in msg, msg
        counts = seen["comps"].groups.counts()
        assert counts["errored"] == 0 and counts["inflight"] > 0, counts  # they waited, none dropped

    asyncio.run(main())


def test_a_teacher_outage_holds_scoring_and_the_run_finishes(tmp_path: Path) -> None:
    """The teacher is down at the start and comes up 2 s later: the stall report names the teacher as
    what the run waits on, no group is dropped, the run trains every step."""

    port = _closed_port()

    async def main() -> dict:
        cfg = _cfg(tmp_path, port, teacher={"outage_timeout_s": 30})
        fake = FakeTeacher(port)

        async def come_up_later(_comps: Any) -> None:
            await asyncio.sleep(2.0)
            await fake.start()

        stalls = StallWatch(component="orchestrator", output_dir=tmp_path, stall_after_s=0.5).start()
        try:
            return await _run(cfg, stalls=stalls, during=come_up_later)
        finally:
            stalls.stop()
            await fake.stop()

    out = asyncio.run(main())
    rows = out["rows"]
    assert len(rows) == 3, rows
    assert sum(r["teacher/errors"] for r in rows) == 0 and rows[-1]["ledger/errored"] == 0, rows
    assert sum(r["teacher/retries"] for r in rows) >= 2 and sum(r["teacher/outage_s"] for r in rows) > 1.5, (
        rows
    )
    reports = [json.loads(line) for line in (tmp_path / "stalls.jsonl").read_text().splitlines()]
    first = reports[0]
    assert first["waits_on"].startswith(f"the teacher (http://127.0.0.1:{port}): unreachable for"), first
    assert "finished group(s) wait for scoring" in first["waits_on"], first


def test_a_teacher_killed_and_restarted_mid_run_is_survived(tmp_path: Path) -> None:
    """The teacher answers, goes down after a few requests (its connections closed), comes back 1.5 s
    later on the same port: every step trains, no episode fails."""

    async def main() -> dict:
        port = _closed_port()
        cfg = _cfg(tmp_path, port, max_steps=6, max_off_policy_steps=6, teacher={"outage_timeout_s": 30})
        fake = await FakeTeacher(port).start()

        async def kill_and_restart(_comps: Any) -> None:
            while fake.requests < 2:
                await asyncio.sleep(0.01)
            await fake.stop()
            await asyncio.sleep(1.5)
            await fake.start()

        try:
            return await _run(cfg, during=kill_and_restart, latency_s=0.1)
        finally:
            await fake.stop()

    rows = asyncio.run(main())["rows"]
    assert len(rows) == 6, rows
    assert sum(r["teacher/errors"] for r in rows) == 0 and rows[-1]["ledger/errored"] == 0, rows
    assert sum(r["teacher/retries"] for r in rows) >= 1 and sum(r["teacher/outage_s"] for r in rows) > 1.0, (
        rows
    )
