"""Environment runners: how verifiers runs an episode's harness (`env.runner`), behind one protocol.

    VerifiersRolloutSource ──runner.run(task, ctx)──► EnvRunner
        inprocess   env.run_episode here, the in-process chat harness (`inprocess_harness.py`)
        subprocess  env.run_episode here, verifiers' `null` harness program in the subprocess runtime
        env_server  verifiers' env server in a spawned process, over ZeroMQ (`env_server.py`)

Who calls it: `verifiers_source.py` (one runner per rollout source, from `make_runner`) and
`verifiers_config.py` (each seat's harness, from `RUNNERS[name].harness()`). Adding a runner is one
class implementing `EnvRunner` plus its entry in `RUNNERS` (and the `env.runner` literal in config/env.py).

Invariants:
- `RUNNERS` is the one place a runner name picks its class; it holds every `env.runner` value;
- `start` either returns with the runner ready to `run`, or raises with nothing of it left running;
- a runner is started at most once; `stop` is safe without a `start`, after a failed one and twice;
- an in-process runner's serving resources (`env.serving()`) are entered and exited in one supervised
  background task between `start` and `stop`, as their async context managers require.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, ClassVar, Protocol

from prime_async.config.env import EnvBaseConfig
from prime_async.rollouts import inprocess_tools
from prime_async.rollouts.env_server import EnvServerRunner

logger = logging.getLogger(__name__)


class EnvRunner(Protocol):
    """Runs the episodes of one loaded verifiers environment.

    `client_in_process`: the train client (model calls) runs in this process, so the rollout source can
    tell it the prompt limit (`prompt_limit.record`) instead of it asking the gateway.
    """

    client_in_process: ClassVar[bool]

    @classmethod
    def harness(cls) -> dict[str, Any]:
        """The harness every seat that does not pin its own gets (a verifiers `harness` config)."""
        ...

    async def start(self, env: Any, config: Any) -> None:
        """Be ready to run episodes of `env` (loaded from the resolved verifiers `config`)."""
        ...

    def check(self) -> None:
        """Raise RuntimeError when the runner can no longer run episodes (its serving stopped)."""
        ...

    async def run(self, task: Any, ctx: Any) -> Any:
        """One verifiers episode of `task` under the model context `ctx`."""
        ...

    async def stop(self) -> None:
        """Release what `start` acquired."""
        ...


class _ServingRunner:
    """Runs episodes in this process while `env.serving()` is held open by a background task."""

    client_in_process: ClassVar[bool] = True

    def __init__(self, env_cfg: EnvBaseConfig) -> None:
        self.env_cfg = env_cfg
        self._env: Any = None
        self._serving: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()

    async def start(self, env: Any, config: Any) -> None:
        self._env = env
        self._serving = asyncio.create_task(self._serve(), name="verifiers-serving")
        ready = asyncio.create_task(self._ready.wait())
        await asyncio.wait({ready, self._serving}, return_when=asyncio.FIRST_COMPLETED)
        if self._serving.done():
            ready.cancel()
            self._serving.result()  # re-raise the serving failure
            raise RuntimeError("verifiers serving exited during startup")

    async def _serve(self) -> None:
        async with self._env.serving():
            self._ready.set()
            await self._stop.wait()

    def check(self) -> None:
        if self._serving is not None and self._serving.done():
            error = None if self._serving.cancelled() else self._serving.exception()
            raise RuntimeError(f"verifiers serving stopped: {error!r}")

    async def run(self, task: Any, ctx: Any) -> Any:
        return await self._env.run_episode(task, ctx)

    async def stop(self) -> None:
        self._stop.set()
        if self._serving is None:
            return
        try:
            await asyncio.wait_for(self._serving, timeout=30)
        except TimeoutError:
            logger.warning("verifiers serving did not stop within 30 s; cancelling it")
            self._serving.cancel()
        except Exception:  # tolerated at shutdown: the failure was already surfaced to run_episode
            logger.warning("verifiers serving failed", exc_info=True)


class SubprocessRunner(_ServingRunner):
    """`subprocess`: verifiers' `null` harness program, launched per episode in the subprocess runtime."""

    @classmethod
    def harness(cls) -> dict[str, Any]:
        return {"id": "null"}


class InProcessRunner(_ServingRunner):
    """`inprocess`: the in-process chat harness; Python toolsets served in process when
    `env.toolsets = "inprocess"`; the harness's pooled model-call clients are held while started."""

    def __init__(self, env_cfg: EnvBaseConfig) -> None:
        super().__init__(env_cfg)
        self._tools_in_process = env_cfg.toolsets == "inprocess"
        self._retains_http_clients = False

    @classmethod
    def harness(cls) -> dict[str, Any]:
        from prime_async.rollouts import inprocess_harness

        return {"id": inprocess_harness.register()}

    async def start(self, env: Any, config: Any) -> None:
        from prime_async.rollouts import inprocess_harness

        await super().start(env, config)
        inprocess_harness.retain_http_clients()
        self._retains_http_clients = True

    async def run(self, task: Any, ctx: Any) -> Any:
        with inprocess_tools.enabled(self._tools_in_process):
            return await super().run(task, ctx)

    async def stop(self) -> None:
        await super().stop()
        if self._retains_http_clients:
            from prime_async.rollouts import inprocess_harness

            self._retains_http_clients = False
            await inprocess_harness.release_http_clients()


RUNNERS: dict[str, type[EnvRunner]] = {
    "inprocess": InProcessRunner,
    "subprocess": SubprocessRunner,
    "env_server": EnvServerRunner,
}
"""`env.runner` -> its runner class: the one place a runner name picks its implementation."""


def make_runner(env_cfg: EnvBaseConfig) -> EnvRunner:
    """An unstarted runner for `env_cfg.runner`."""
    return RUNNERS[env_cfg.runner](env_cfg)
