"""The `eval` command: evaluate `model.path` and/or versions a run published, on environments.

    versions (model.path = v0 | run_dir/broadcasts/step_<n>, STABLE only)
      ──► engines: the embedded engine started here (`inference` as a child process, stopped on every
          way out) or `inference.base_urls` (SGLang-compatible; they must see run_dir)
      ──► per version: /update_weights_from_disk (a broadcast) ──► evaluate(envs) ──► metrics/eval.jsonl
          (step = version), eval/samples_v<version>.jsonl (as in a run), wandb (metrics + a samples
          table), stdout

Called by `entrypoints/eval.py`. Invariants: versions are evaluated in ascending order, each from its
STABLE broadcast (a missing one is a ValueError naming it before anything starts); the same examples
(the first `num_examples` of each taskset) are used for every version, so the figures compare; the
embedded engine never outlives the command.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from prime_async.config.eval import EvalConfig
from prime_async.config.inference import InferenceConfig
from prime_async.eval.episodes import Decode, EvalEnv, evaluate
from prime_async.eval.setup import eval_envs, tokenizer_decode, write_samples
from prime_async.launcher.identity import free_ports
from prime_async.launcher.process import ChildProcess
from prime_async.launcher.rl import ensure_model, script_command
from prime_async.weights.broadcasts import broadcasts_root, is_stable, latest_stable, version_dir

if TYPE_CHECKING:
    from prime_async.utils.monitor import Monitor

logger = logging.getLogger(__name__)


def versions_to_evaluate(cfg: EvalConfig) -> list[tuple[int, Path | None]]:
    """`(version, broadcast directory or None = the engine's initial model)`, ascending."""
    run_dir = cfg.weights.run_dir
    if run_dir is None:
        return [(0, None)]
    root = broadcasts_root(run_dir)
    steps = list(cfg.weights.steps)
    if not steps:
        newest = latest_stable(root)
        if newest is None:
            raise ValueError(f"weights.run_dir: {run_dir} has no STABLE broadcast under {root}")
        steps = [newest]
    out: dict[int, Path | None] = {0: None} if cfg.weights.include_base else {}
    for step in steps:
        if is_stable(root, step):
            out[step] = version_dir(root, step)
        elif step == 0:
            out[0] = None  # version 0 is the initial model: no broadcast of it is published
        else:
            raise ValueError(f"weights.steps: {version_dir(root, step)} is missing or has no STABLE marker")
    return sorted(out.items())


def embedded_engine_config(cfg: EvalConfig, port: int) -> InferenceConfig:
    return InferenceConfig(
        model=cfg.model, output_dir=cfg.output_dir, seq_len=cfg.seq_len, wandb={"enabled": False},
        log=cfg.log, server={"port": port}, engine=cfg.inference.engine,
    )  # fmt: skip


def _start_engine(cfg: EvalConfig, stack: contextlib.ExitStack) -> str:
    """Start the embedded engine as a child process; its URL. `stack` stops it."""
    import tomli_w

    port = cfg.inference.port or free_ports("127.0.0.1", 1)
    engine_cfg = embedded_engine_config(cfg, port)
    path = Path(cfg.output_dir) / "configs" / "eval_inference.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(engine_cfg.model_dump(mode="json", exclude_none=True)))
    component = ChildProcess(
        name="inference", command=[*script_command("inference"), "@", str(path)],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        log_path=Path(cfg.output_dir) / "logs" / "eval_inference.log",
        health_url=f"http://127.0.0.1:{port}/health",
    )  # fmt: skip
    component.start()
    stack.callback(component.stop, timeout_s=20.0)
    component.wait_healthy(timeout_s=cfg.inference.startup_timeout_s, stop_flag=[])
    return f"http://127.0.0.1:{port}"


def run(cfg: EvalConfig) -> None:
    """Evaluate every version of `versions_to_evaluate(cfg)`; prints one line per version and env."""
    versions = versions_to_evaluate(cfg)  # bad weights fail before any process starts
    ensure_model(cfg)
    with contextlib.ExitStack() as stack:
        urls = list(cfg.inference.base_urls) or [_start_engine(cfg, stack)]
        asyncio.run(_evaluate_versions(cfg, urls, versions))


async def _evaluate_versions(cfg: EvalConfig, urls: list[str], versions: list[tuple[int, Path | None]]):
    from prime_async.inference.client import HttpEngineClient
    from prime_async.rollouts.engine_checks import wait_for_engines
    from prime_async.rollouts.env_sources import build_sources
    from prime_async.utils.monitor import Monitor

    engines = [HttpEngineClient(url, cfg.inference.api_key) for url in urls]
    monitor = Monitor(output_dir=cfg.output_dir, name="eval", wandb_cfg=cfg.wandb,
                      config=cfg.model_dump(mode="json"))  # fmt: skip
    try:
        await wait_for_engines(engines, timeout_s=cfg.inference.startup_timeout_s)
        sources = build_sources(list(cfg.envs), engines, model_path=cfg.model.path, seq_len=cfg.seq_len)
        async with contextlib.AsyncExitStack() as stack:
            for source in sources.values():
                await stack.enter_async_context(source)
            envs = eval_envs(cfg.envs, list(sources.values()), base_sampling=cfg.sampling)
            decode = tokenizer_decode(cfg.model.path)
            for version, path in versions:
                if path is not None:
                    await asyncio.gather(
                        *(e.update_weights_from_disk(str(path), version, flush_cache=True) for e in engines)
                    )
                await _evaluate_version(cfg, envs, monitor, decode, version, path)
    finally:
        monitor.close()
        await asyncio.gather(*(e.aclose() for e in engines), return_exceptions=True)


async def _evaluate_version(
    cfg: EvalConfig, envs: list[EvalEnv], monitor: Monitor, decode: Decode, version: int, path: Path | None
) -> None:
    """Evaluate the weights the engines serve now (`version`); log, write and print the results."""
    result = await evaluate(
        envs, version=version, max_concurrent_episodes=cfg.max_concurrent_episodes, decode=decode
    )
    samples = write_samples(Path(cfg.output_dir) / "eval" / f"samples_v{version}.jsonl", result.samples)
    monitor.log(result.metrics, step=version)
    if cfg.wandb_table:
        monitor.log_table("eval/samples", result.samples)
    label = str(path) if path is not None else f"{cfg.model.path} (initial weights)"
    print(f"weights v{version}: {label}; samples: {samples}", flush=True)
    for line in result.summary([env.name for env in envs]):
        print(line, flush=True)
