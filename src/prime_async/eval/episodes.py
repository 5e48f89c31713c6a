"""One evaluation: every eval environment's examples, `rollouts_per_example` episodes each, at one weights
version; the metrics and the samples. Shared by the orchestrator's in-run eval and the `eval` command.

    evaluate(envs, version) ──for each env, in order──► RolloutSource.run_episode (engine_key "eval-...")
        ──► EvalResult(version, metrics `eval/<name>/...`, samples [{env, example_id, rollout, reward, ...}])

Metrics per environment `<name>` (k = `rollouts_per_example`):
- `eval/<name>/reward/mean`: mean reward over all k episodes of every example (avg@k); a failed episode
  counts as reward 0 (it is also counted in `num_errors`);
- `eval/<name>/pass@<k>`: fraction of examples with at least one episode whose reward >= pass_threshold;
- `eval/<name>/num_episodes`, `eval/<name>/num_errors` (status other than ok), `eval/<name>/time`
  (wall seconds of this environment's episodes);
- `eval/<name>/num_idle`: trajectories of seats that never acted (`status="idle"`, multi-agent envs);
  they say nothing about the policy, so they are in none of the other metrics;
- `eval/<name>/off_version_tokens`: sampled tokens the engine reported under a version other than the
  evaluated one (0 when the version was pinned for the whole eval);
- the env's own values (`rollouts/episode.env_values`): `eval/<name>/metric/<metric>` (each
  `@vf.metric`) and `eval/<name>/reward_fn/<reward>` (each reward function's unweighted score), each the
  mean over the episodes that carry it; every sample holds them too (`metrics`, `rewards`);
and `eval/weight_version` = the version the eval ran at.

Invariants: eval episodes never reach the group table, the train sink or the trainer (this module has no
reference to them); a failed episode never raises (the rollout source's contract); a multi-agent env
contributes one sample per trained seat trajectory.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prime_async.engine_api import SamplingParams
from prime_async.rollouts.episode import split_env_values
from prime_async.rollouts.types import Episode, RolloutSource

Decode = Callable[[list[int]], str]


@dataclass
class EvalEnv:
    """One eval environment, ready to run: its source and the example ids it evaluates."""

    name: str
    source: RolloutSource
    sampling: SamplingParams
    example_ids: list[int]
    rollouts_per_example: int = 1
    pass_threshold: float = 1.0


@dataclass
class EvalResult:
    """The outcome of `evaluate` at `version`."""

    version: int
    metrics: dict[str, float] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)

    def summary(self, names: Sequence[str]) -> list[str]:
        """One console line per environment."""
        lines = []
        for name in names:
            prefix = f"eval/{name}/"
            m = {k.removeprefix(prefix): v for k, v in self.metrics.items() if k.startswith(prefix)}
            pass_key = next(k for k in m if k.startswith("pass@"))
            lines.append(
                f"eval v{self.version} {name}: reward/mean {m['reward/mean']:.4f} {pass_key} "
                f"{m[pass_key]:.4f} | {m['num_episodes']:.0f} episodes, {m['num_errors']:.0f} errors, "
                f"{m['time']:.1f} s"
            )
        return lines


def example_ids(name: str, available: int | None, wanted: int | None) -> list[int]:
    """The first `wanted` example ids (all of a finite taskset when None); ValueError when impossible."""
    if wanted is None:
        if available is None:
            raise ValueError(f"eval env {name!r} has an infinite taskset: set its num_examples")
        return list(range(available))
    if available is not None and wanted > available:
        raise ValueError(f"eval env {name!r}: num_examples = {wanted} but the taskset has {available} tasks")
    return list(range(wanted))


def split_text(ep: Episode, decode: Decode | None) -> tuple[str, str]:
    """(prompt, completion) text: tokens before the first sampled token, and the rest."""
    if decode is None or not ep.token_ids:
        return "", ""
    first = next((i for i, m in enumerate(ep.loss_mask) if m), len(ep.token_ids))
    return decode(ep.token_ids[:first]), decode(ep.token_ids[first:])


async def _run_env(
    env: EvalEnv, version: int, gate: asyncio.Semaphore
) -> list[tuple[int, int, list[Episode]]]:
    async def one(example_id: int, rollout: int) -> tuple[int, int, list[Episode]]:
        async with gate:
            result = await env.source.run_episode(
                example_id=example_id,
                engine_key=f"eval-v{version}-{env.name}-{example_id}-{rollout}",
                sampling=env.sampling,
            )
        return example_id, rollout, result if isinstance(result, list) else [result]

    jobs = [one(e, r) for e in env.example_ids for r in range(env.rollouts_per_example)]
    return await asyncio.gather(*jobs)


def env_metrics(env: EvalEnv, version: int, runs: list[tuple[int, int, list[Episode]]]) -> dict[str, float]:
    """`eval/<name>/...` of one environment's episodes (module docstring)."""
    rewards: list[float] = []
    passed: dict[int, bool] = {}
    errors = off_version = idle = 0
    for example_id, _, episodes in runs:
        for ep in episodes:
            if ep.status == "idle":
                idle += 1
                continue
            ok = ep.status == "ok" and ep.reward is not None
            reward = float(ep.reward) if ok else 0.0
            errors += not ok
            rewards.append(reward)
            passed[example_id] = passed.get(example_id, False) or (ok and reward >= env.pass_threshold)
            sampled = (v for v, m in zip(ep.token_versions, ep.loss_mask, strict=False) if m and v >= 0)
            off_version += sum(v != version for v in sampled)
    prefix = f"eval/{env.name}"
    return {
        **_env_value_means(prefix, [ep for _, _, eps in runs for ep in eps if ep.status != "idle"]),
        f"{prefix}/reward/mean": sum(rewards) / max(len(rewards), 1),
        f"{prefix}/pass@{env.rollouts_per_example}": sum(passed.values()) / max(len(passed), 1),
        f"{prefix}/num_episodes": float(len(rewards)),
        f"{prefix}/num_errors": float(errors),
        f"{prefix}/num_idle": float(idle),
        f"{prefix}/off_version_tokens": float(off_version),
    }


def _env_value_means(prefix: str, episodes: list[Episode]) -> dict[str, float]:
    """`<prefix>/metric/<metric>` and `<prefix>/reward_fn/<reward>`: means over the episodes carrying them."""
    sums: dict[str, list[float]] = {}
    for ep in episodes:
        metrics, rewards = split_env_values(ep.metrics)
        for kind, values in (("metric", metrics), ("reward_fn", rewards)):
            for key, value in values.items():
                sums.setdefault(f"{prefix}/{kind}/{key}", []).append(float(value))
    return {key: sum(values) / len(values) for key, values in sums.items()}


def _samples(
    env: EvalEnv, version: int, runs: list[tuple[int, int, list[Episode]]], decode: Decode | None
) -> list[dict[str, Any]]:
    out = []
    for example_id, rollout, episodes in runs:
        for ep in episodes:
            prompt, completion = split_text(ep, decode)
            metrics, rewards = split_env_values(ep.metrics)
            out.append({
                "env": env.name, "version": version, "example_id": example_id, "rollout": rollout,
                "seat": ep.seat, "reward": ep.reward, "status": ep.status, "error": ep.error,
                "prompt": prompt, "completion": completion, "metrics": metrics, "rewards": rewards,
            })  # fmt: skip
    return out


async def evaluate(
    envs: Sequence[EvalEnv],
    *,
    version: int,
    max_concurrent_episodes: int,
    decode: Decode | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> EvalResult:
    """Run every environment's eval episodes at `version` (envs one after the other) and score them."""
    result = EvalResult(version=version, metrics={"eval/weight_version": float(version)})
    gate = asyncio.Semaphore(max_concurrent_episodes)
    for env in envs:
        start = clock()
        runs = await _run_env(env, version, gate)
        result.metrics.update(env_metrics(env, version, runs))
        result.metrics[f"eval/{env.name}/time"] = clock() - start
        result.samples.extend(_samples(env, version, runs, decode))
    return result
