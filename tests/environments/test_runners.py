"""Environment runners (`rollouts/runners.py`): one class per `env.runner` value behind `EnvRunner`, and the
in-process serving lifecycle, on a stand-in environment (no verifiers import)."""

from __future__ import annotations

import asyncio
import contextlib
import typing
from collections.abc import AsyncIterator
from typing import Any

import pytest

from prime_async.config.env import EnvBaseConfig, EnvConfig
from prime_async.rollouts.runners import RUNNERS, SubprocessRunner, make_runner


def test_every_runner_value_has_one_runner_class() -> None:
    values = set(typing.get_args(EnvBaseConfig.model_fields["runner"].annotation))
    assert set(RUNNERS) == values
    for name, cls in RUNNERS.items():
        assert isinstance(cls.client_in_process, bool), name
        assert type(make_runner(EnvConfig(id="x", runner=name))) is cls
    assert SubprocessRunner.harness() == {"id": "null"} == RUNNERS["env_server"].harness()
    assert not RUNNERS["env_server"].client_in_process and SubprocessRunner.client_in_process


class _Env:
    """Stand-in for a verifiers env: `serving()` is entered once; `run_episode` echoes its task."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.entered = self.exited = 0

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        if self.fail:
            raise OSError("port taken")
        self.entered += 1
        try:
            yield
        finally:
            self.exited += 1

    async def run_episode(self, task: Any, ctx: Any) -> Any:
        return (task, ctx)


def test_serving_runner_holds_serving_between_start_and_stop() -> None:
    async def main() -> None:
        await SubprocessRunner(EnvConfig(id="x", runner="subprocess")).stop()  # never started: a no-op
        env, runner = _Env(), SubprocessRunner(EnvConfig(id="x", runner="subprocess"))
        await runner.start(env, config=None)
        runner.check()
        assert await runner.run("task", "ctx") == ("task", "ctx") and env.entered == 1
        await runner.stop()
        await runner.stop()
        assert env.exited == 1
        with pytest.raises(RuntimeError, match="verifiers serving stopped"):
            runner.check()

    asyncio.run(main())


def test_serving_failure_at_start_is_raised() -> None:
    async def main() -> None:
        runner = SubprocessRunner(EnvConfig(id="x", runner="subprocess"))
        with pytest.raises(OSError, match="port taken"):
            await runner.start(_Env(fail=True), config=None)
        await runner.stop()

    asyncio.run(main())
