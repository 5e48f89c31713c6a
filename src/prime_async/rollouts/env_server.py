"""Env-server runner: verifiers' own serving path (what prime-rl uses) for `env.runner = "env_server"`.

    VerifiersRolloutSource ──EnvServerRunner.run──► EnvClient.run (ZMQ DEALER, msgpack)
        ──► EnvServer (spawned process)
        └── Env.run_episode there (null harness program in the subprocess runtime)
              ──POST /inference/v1/generate──► our Gateway (in the orchestrator process)

Who calls it: `rollouts/verifiers_source.py` through the `EnvRunner` protocol (`runners.py`). The server
is one spawned process running `verifiers.v1.serve.serve_env(max_workers=1)` on a loopback port picked
by the OS.

Invariants: the server process is started by `start()` and terminated by `stop()` (SIGTERM, then kill
after a timeout); cancelling `run` sends verifiers' own cancel request to the server, which aborts the
rollout there (the gateway aborts the engine request on our side).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from typing import Any, ClassVar

from prime_async.config.env import EnvBaseConfig

logger = logging.getLogger(__name__)


def _serve(config_data: dict[str, Any], address_queue: Any) -> None:
    from verifiers.v1.serve.pool import serve_env

    from prime_async.utils import pydantic_speedups

    pydantic_speedups.install()

    serve_env(
        max_workers=1, address="tcp://127.0.0.1:0", address_queue=address_queue, config_data=config_data
    )


class EnvServerRunner:
    """`EnvRunner` for `env_server`: owns one env-server process and the ZMQ client that talks to it;
    the train client runs in the server process. Each seat gets verifiers' `null` harness program."""

    client_in_process: ClassVar[bool] = False

    def __init__(self, env_cfg: EnvBaseConfig | None = None, *, startup_timeout_s: float = 300.0) -> None:
        self.env_cfg = env_cfg
        self.startup_timeout_s = startup_timeout_s
        self._proc: Any = None
        self._client: Any = None

    @classmethod
    def harness(cls) -> dict[str, Any]:
        return {"id": "null"}

    def check(self) -> None:
        """Nothing to check here: `run` refuses once the server process is gone."""

    async def start(self, env: Any, config: Any) -> None:
        """Spawn the server for the resolved verifiers `config` (`env`, loaded here, is not used: the
        server loads its own) and connect to it; on failure nothing is left running."""
        try:
            await self._start(config)
        except BaseException:
            await self.stop()
            raise

    async def _start(self, config: Any) -> None:
        from verifiers.v1.serve.client import EnvClient
        from verifiers.v1.serve.pool import env_config_data

        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        self._proc = ctx.Process(target=_serve, args=(env_config_data(config), queue), daemon=True)
        self._proc.start()
        try:
            address = await asyncio.to_thread(queue.get, True, self.startup_timeout_s)
        except Exception as e:
            raise RuntimeError(f"verifiers env server did not report its address: {e!r}") from e
        self._client = EnvClient(address)
        await self._client.wait_for_server_startup(timeout=self.startup_timeout_s)
        logger.info("verifiers env server at %s (pid %s)", address, self._proc.pid)

    async def run(self, task: Any, ctx: Any) -> Any:
        if self._proc is None or not self._proc.is_alive():
            raise RuntimeError("verifiers env server process is not running")
        data = task.data.model_dump(mode="json")
        return await self._client.run(ctx.client, ctx.model, ctx.sampling, data)

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
        if self._proc is not None:
            self._proc.terminate()
            await asyncio.to_thread(self._proc.join, 30)
            if self._proc.is_alive():
                self._proc.kill()
                await asyncio.to_thread(self._proc.join, 10)
            self._proc = None
