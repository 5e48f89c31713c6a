"""Rollout source backed by verifiers v1: loads an environment by id and runs single episodes of it
against inference through the token gateway.

    dispatcher ──run_episode(example_id, engine_key, sampling)──► VerifiersRolloutSource
        verifiers Env.run_episode(task, ModelContext(model=<gateway session key>, client=TrainClientConfig))
          (runner `env_server`: the same call inside verifiers' env server process, over ZeroMQ)
          harness (in-process chat loop | `null` program in a subprocess) ──► interception server
            ──► TrainClient (renders the chat template to token ids) ──POST /inference/v1/generate──► Gateway
                ──► EngineClient.generate on the session's sticky engine (SGLang /generate)
        ◄── Episode (token_ids, loss_mask, sampler_logprobs, token_versions, reward, status)

Who calls it: `orchestrator.py` builds it with `build_rollout_source(...)` and hands it to the dispatcher
as its `RolloutSource`. `import verifiers.v1` is slow (10-20 s), so it happens in `start()`, never at
module import (`--help` stays fast).

Invariants:
- the environment is loaded through verifiers' own path (`resolve_env_config` -> `load_environment`), and
  example `i` is the i-th task of `env.taskset` (its `load()` order), fixed for the run;
- `run_episode` never raises for environment faults (see `rollout_episode.py`); it raises
  `asyncio.CancelledError` when cancelled, after aborting the episode's in-flight engine requests;
- every gateway session opened for an episode is closed when the episode ends, whatever the outcome;
- verifiers' serving resources live in one supervised background task between `start()` and `stop()`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from prime_async.config.env import EnvConfig
from prime_async.inference.types import EngineClient
from prime_async.orchestrator.gateway import Gateway
from prime_async.orchestrator.types import Episode

logger = logging.getLogger(__name__)


def _quiet_library_loggers() -> None:
    """verifiers logs two INFO lines per rollout and uvicorn/renderers chat too: keep them at WARNING
    unless the user asked for DEBUG or set their levels explicitly (handlers stay the entrypoint's)."""
    if logging.getLogger().getEffectiveLevel() <= logging.DEBUG:
        return
    for name in ("verifiers", "renderers", "uvicorn", "uvicorn.error"):
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.WARNING)


def verifiers_env_config(env_cfg: EnvConfig) -> dict[str, Any]:
    """The raw verifiers env config for `env_cfg` (validated later by `vf.resolve_env_config`)."""
    if env_cfg.runner == "inprocess":
        from prime_async.orchestrator import rollout_harness

        harness: dict[str, Any] = {"id": rollout_harness.register()}
    else:
        harness = {"id": "null"}
    raw: dict[str, Any] = {
        "taskset": {**env_cfg.args, "id": env_cfg.id},
        "agent": {"runtime": {"type": "subprocess"}, "harness": harness},
    }
    if env_cfg.episode_timeout_s is not None:
        raw["timeout"] = {"episode": env_cfg.episode_timeout_s}
    return raw


class VerifiersRolloutSource:
    """`RolloutSource` over a verifiers environment. Use `async with` or `start()`/`stop()`."""

    def __init__(
        self, *, env_cfg: EnvConfig, engines: list[EngineClient], model_path: str, seq_len: int
    ) -> None:
        self.env_cfg = env_cfg
        self.model_path = model_path
        self.seq_len = seq_len
        self.gateway = Gateway(
            engines=engines, seq_len=seq_len, host=env_cfg.gateway_host, port=env_cfg.gateway_port
        )
        self._env: Any = None
        self._tasks: list[Any] = []
        self._client_cfg: Any = None
        self._serving: asyncio.Task[None] | None = None
        self._env_server: Any = None
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self.counts: dict[str, int] = {"ok": 0, "error": 0, "aborted": 0, "cancelled": 0}
        self.error_kinds: dict[str, int] = {}
        self.episode_seconds = 0.0

    @property
    def num_examples(self) -> int:
        assert self._env is not None, "start() the rollout source first"
        return len(self._tasks)

    async def start(self) -> None:
        t0 = time.perf_counter()
        _quiet_library_loggers()
        import verifiers.v1 as vf

        config = vf.resolve_env_config(verifiers_env_config(self.env_cfg))
        self._env = vf.load_environment(config)
        if not self._env.taskset.bounded:
            raise ValueError(f"env.id {self.env_cfg.id!r} is an infinite taskset; bound it in env.args")
        self._tasks = list(self._env.taskset)
        if not self._tasks:
            raise ValueError(f"env.id {self.env_cfg.id!r} loaded no tasks; check env.args")
        await self.gateway.start()
        self._client_cfg = vf.TrainClientConfig(
            base_url=f"{self.gateway.base_url}/v1",
            api_key_var="PRIME_ASYNC_GATEWAY_KEY",
            renderer=self.env_cfg.renderer,
            renderer_model_name=self.model_path,
        )
        if self.env_cfg.runner == "env_server":
            await self._start_env_server(config)
        else:
            await self._start_serving()
        logger.info(
            "env %s: %d examples, runner=%s, gateway %s (%.1fs)",
            self.env_cfg.id, len(self._tasks), self.env_cfg.runner, self.gateway.base_url,
            time.perf_counter() - t0,
        )  # fmt: skip

    async def _start_env_server(self, config: Any) -> None:
        from prime_async.orchestrator.rollout_env_server import EnvServerRunner

        self._env_server = EnvServerRunner()
        try:
            await self._env_server.start(config)
        except BaseException:
            await self.gateway.stop()
            raise
        self._ready.set()

    async def _start_serving(self) -> None:
        self._serving = asyncio.create_task(self._serve(), name="verifiers-serving")
        ready = asyncio.create_task(self._ready.wait())
        await asyncio.wait({ready, self._serving}, return_when=asyncio.FIRST_COMPLETED)
        if self._serving.done():
            ready.cancel()
            await self.gateway.stop()
            self._serving.result()  # re-raise the serving failure
            raise RuntimeError("verifiers serving exited during startup")

    async def _serve(self) -> None:
        # verifiers' serving resources (interception servers, shared tools) are entered and exited in
        # this one task, as their async context managers require.
        async with self._env.serving():
            self._ready.set()
            await self._stop.wait()

    async def stop(self) -> None:
        self._stop.set()
        if self._env_server is not None:
            await self._env_server.stop()
        if self._serving is not None:
            try:
                await asyncio.wait_for(self._serving, timeout=30)
            except TimeoutError:
                logger.warning("verifiers serving did not stop within 30 s; cancelling it")
                self._serving.cancel()
            except Exception:  # tolerated at shutdown: the failure was already surfaced to run_episode
                logger.warning("verifiers serving failed", exc_info=True)
        await self.gateway.stop()

    async def __aenter__(self) -> VerifiersRolloutSource:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _check_serving(self) -> None:
        if not self._ready.is_set():
            raise RuntimeError("rollout source is not started")
        if self._serving is not None and self._serving.done():
            error = None if self._serving.cancelled() else self._serving.exception()
            raise RuntimeError(f"verifiers serving stopped: {error!r}")

    async def run_episode(self, *, example_id: int, engine_key: str, sampling: dict[str, Any]) -> Episode:
        import verifiers.v1 as vf

        from prime_async.orchestrator.rollout_episode import build_episode

        self._check_serving()
        assert 0 <= example_id < len(self._tasks), f"example_id {example_id} out of range"
        session = self.gateway.open_session(engine_key=engine_key, sampling=sampling)
        ctx = vf.ModelContext(
            client=self._client_cfg, model=session.key, sampling=vf.SamplingConfig(**sampling)
        )
        t0 = time.perf_counter()
        try:
            task = self._tasks[example_id]
            if self._env_server is not None:
                vf_episode = await self._env_server.run(task, ctx)
            else:
                vf_episode = await self._env.run_episode(task, ctx)
            episode = build_episode(
                example_id=example_id, vf_episode=vf_episode, session=session, seq_len=self.seq_len
            )
        except asyncio.CancelledError:
            self.counts["cancelled"] += 1
            await asyncio.shield(self.gateway.cancel_session(session.key))
            raise
        except Exception as e:  # tolerated: an env fault that escaped verifiers' own episode boundary
            logger.warning(
                "episode of example %d failed outside verifiers' boundary", example_id, exc_info=True
            )
            episode = Episode(
                example_id=example_id, status="error", error=f"rollout: {type(e).__name__}: {e}"
            )
            episode.metrics["env_error"] = "rollout"
        finally:
            self.gateway.close_session(session.key)
            self.episode_seconds += time.perf_counter() - t0
        self.counts[episode.status] = self.counts.get(episode.status, 0) + 1
        if kind := episode.metrics.get("env_error"):
            self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1
        return episode

    def metrics(self) -> dict[str, float]:
        """Episode outcome counts since start (`env/episodes/<status>`, `env/errors/<kind>`)."""
        out: dict[str, float] = {f"env/episodes/{k}": float(v) for k, v in self.counts.items()}
        out.update({f"env/errors/{k}": float(v) for k, v in self.error_kinds.items()})
        out["env/gateway_requests"] = float(self.gateway.num_requests)
        return out


def build_rollout_source(
    *, env_cfg: EnvConfig, engines: list[EngineClient], model_path: str, seq_len: int
) -> VerifiersRolloutSource:
    """The verifiers-backed `RolloutSource` for `env_cfg`; `start()` it (or `async with`) before use."""
    return VerifiersRolloutSource(env_cfg=env_cfg, engines=engines, model_path=model_path, seq_len=seq_len)
