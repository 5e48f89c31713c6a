"""Probe episodes for the doctor: the run's environments against one engine serving version 0.

    engine: the run's `[inference]` started here as a child process (stopped on every way out), or the
            engines `orchestrator.inference.base_urls` names when they are set (SGLang-compatible)
    per env: the first `examples` examples, the `longest` examples with the largest task data (the likely
             longest prompts), each run once; `repeats` examples run twice with one sampling seed.

Every probe keeps the model calls its episode made (`VerifiersRolloutSource.call_log`). Probes run with
the run's sampling (temperature, top_p, max_tokens); the engine never loads another version.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prime_async.config.rl import RLConfig
from prime_async.doctor.checks import Probe
from prime_async.engine_api import SamplingParams
from prime_async.eval.setup import merged_sampling
from prime_async.rollouts.seeds import derive_seed

SCAN_LIMIT = 2000  # tasks whose size is read to find the longest prompts


@dataclass
class EnvProbes:
    env: str
    probes: list[Probe] = field(default_factory=list)
    pairs: list[tuple[Probe, Probe]] = field(default_factory=list)
    sampling: SamplingParams | None = None


def start_engine(cfg: RLConfig, out_dir: Path, stack: contextlib.ExitStack) -> str:
    """Start the run's inference config as one embedded/SGLang server on a free port; its URL."""
    import tomli_w

    from prime_async.config.inference import InferenceConfig
    from prime_async.launcher.identity import free_ports
    from prime_async.launcher.process import ChildProcess
    from prime_async.launcher.rl import script_command

    port = free_ports("127.0.0.1", 1)
    data = cfg.inference.model_dump(mode="json", exclude_none=True)
    data.update(output_dir=str(out_dir), wandb={"enabled": False})
    data["server"] = {**data.get("server", {}), "port": port, "host": "127.0.0.1"}
    if "sglang" in data:
        data["sglang"] = {**data["sglang"], "num_engines": 1}
    engine_cfg = InferenceConfig.model_validate(data)
    path = out_dir / "configs" / "doctor_inference.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(engine_cfg.model_dump(mode="json", exclude_none=True)))
    component = ChildProcess(
        name="inference", command=[*script_command("inference"), "@", str(path)],
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, log_path=out_dir / "logs" / "doctor_inference.log",
        health_url=f"http://127.0.0.1:{port}/health",
    )  # fmt: skip
    component.start()
    stack.callback(component.stop, timeout_s=20.0)
    component.wait_healthy(timeout_s=cfg.launch.startup_timeout_s, stop_flag=[])
    return f"http://127.0.0.1:{port}"


def _task_size(task: Any) -> int:
    data = getattr(task, "data", task)
    dump = getattr(data, "model_dump", None)
    return len(json.dumps(dump(mode="json") if dump else str(data), default=str))


def longest_examples(source: Any, count: int) -> list[int]:
    """The `count` example ids with the largest task data among the first `SCAN_LIMIT`."""
    limit = SCAN_LIMIT if source.num_examples is None else min(SCAN_LIMIT, source.num_examples)
    sizes = []
    for i in range(limit):
        try:
            sizes.append((_task_size(source.task(i)), i))
        except IndexError:
            break
    return [i for _, i in sorted(sizes, reverse=True)[:count]]


async def _probe(source: Any, example_id: int, key: str, sampling: SamplingParams, seed: int | None) -> Probe:
    seeded = dataclasses.replace(sampling, seed=seed)
    out = await source.run_episode(example_id=example_id, engine_key=key, sampling=seeded)
    episodes = out if isinstance(out, list) else [out]
    return Probe(example_id, episodes, source.call_log.pop(key, []), seed)


async def probe_env(
    source: Any, env_cfg: Any, cfg: RLConfig, *, examples: int, longest: int, repeats: int
) -> EnvProbes:
    """Run the probes of one started source (module docstring)."""
    source.call_log = {}
    sampling = merged_sampling(cfg.orchestrator.sampling, env_cfg.sampling)
    ids = list(range(min(examples, source.num_examples or examples)))
    ids += [i for i in longest_examples(source, longest) if i not in ids]
    label = env_cfg.label
    probes = await asyncio.gather(*(_probe(source, i, f"doctor-{label}-{i}", sampling, None) for i in ids))
    pairs = []
    for i in ids[:repeats]:
        seed = derive_seed("doctor", label, i)
        a = await _probe(source, i, f"doctor-{label}-{i}-a", sampling, seed)
        b = await _probe(source, i, f"doctor-{label}-{i}-b", sampling, seed)
        pairs.append((a, b))
    return EnvProbes(label, list(probes), pairs, sampling)


async def collect(
    cfg: RLConfig, urls: list[str], *, examples: int, longest: int, repeats: int
) -> list[EnvProbes]:
    """Probes of every training env of the run, one env after the other, against `urls`."""
    from prime_async.inference.client import HttpEngineClient
    from prime_async.rollouts.engine_checks import wait_for_engines
    from prime_async.rollouts.env_sources import build_sources

    engines = [HttpEngineClient(url, cfg.orchestrator.inference.api_key) for url in urls]
    try:
        await wait_for_engines(engines, timeout_s=cfg.launch.startup_timeout_s)
        envs = list(cfg.orchestrator.envs)
        sources = build_sources(envs, engines, model_path=cfg.model.path, seq_len=cfg.seq_len)
        out = []
        for env_cfg in envs:
            async with sources[env_cfg.label] as source:
                out.append(
                    await probe_env(source, env_cfg, cfg, examples=examples, longest=longest, repeats=repeats)
                )
        return out
    finally:
        await asyncio.gather(*(e.aclose() for e in engines), return_exceptions=True)
