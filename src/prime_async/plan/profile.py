"""What one run measured, as the simulator needs it: read from a run directory's metrics.

    metrics/episodes.jsonl     `seconds` of every ok episode   ──► latencies, by group (drawn per group)
    metrics/trainer.jsonl      time/train + min time/publish_weights ──► train time per step
                               time/write_weights                ──► background weight write
    metrics/orchestrator.jsonl time/sync_weights, time/cut       ──► weight update, batch cut time
                               time/step                         ──► the measured step time
                               inference/vision_s, rollout/images_per_episode ──► image prefill (VLMs)

The first `warmup` steps are left out everywhere (process start, first compilation, the first batch that
waits for the whole pipeline to fill): the figures describe the steady state.

Images (a vision-language model): an image's cost at the engine is its prefill tokens plus the vision
tower's time. Both are inside the measured episode latencies (an episode's `seconds` include its model
calls' prefill), so every simulated group draws them with its latencies and the prediction counts them.
The profile also reads them apart, to show what images cost: the vision tower's seconds per steady-state
step (`inference/vision_s`, the engines' tower time since the previous step), the images per trained
episode, and from both the tower's time per image (each episode's images encoded once: a later turn that
resends an image hits the engine's embedding cache). Text runs log neither metric: both stay 0.
"""

from __future__ import annotations

import statistics
import tomllib
from dataclasses import dataclass
from pathlib import Path

from prime_async.launcher.child_run import run_rl
from prime_async.utils.monitor import read_jsonl

WARMUP_STEPS = 3


@dataclass(frozen=True)
class Profile:
    """Steady-state timings of one run (seconds)."""

    run_dir: Path
    steps: int
    latency_groups: tuple[tuple[float, ...], ...]  # episode seconds of each steady-state group
    train_time_s: float  # time/train + the snapshot part of time/publish_weights (its no-wait minimum)
    write_time_s: float  # time/write_weights: the background write until engines can load the version
    update_time_s: float
    cut_time_s: float
    step_time_s: float  # measured: mean orchestrator time/step after the warm-up
    engines: int = 1
    concurrency_per_engine: float = (
        1.0  # most episodes running on one engine at once (the latencies hold up to it)
    )
    vision_time_s: float = 0.0  # the engines' vision-tower seconds per step (inside the latencies)
    images_per_episode: float = 0.0
    episodes_per_step: float = 0.0

    @property
    def vision_s_per_image(self) -> float:
        """The vision tower's seconds per image encoded (0 without images)."""
        images = self.images_per_episode * self.episodes_per_step
        return self.vision_time_s / images if images > 0 else 0.0

    def describe_images(self) -> str:
        """'' for a text run; else what images cost (module docstring)."""
        if self.images_per_episode <= 0:
            return ""
        return (
            f", images {self.images_per_episode:.1f} per episode: vision tower "
            f"{self.vision_time_s:.3f}s/step ({1000 * self.vision_s_per_image:.1f} ms per image; with the "
            "image tokens' prefill inside the episode latencies)"
        )

    @property
    def latency_samples(self) -> list[float]:
        return [s for group in self.latency_groups for s in group]

    def describe(self) -> str:
        lat = sorted(self.latency_samples)
        return (
            f"profile of {self.run_dir} ({self.steps} steps): episode p50 {_q(lat, 0.5):.3f}s "
            f"p90 {_q(lat, 0.9):.3f}s ({len(lat)} episodes), train {self.train_time_s:.3f}s/step, "
            f"weight write {self.write_time_s:.3f}s, engine update {self.update_time_s:.3f}s, "
            f"batch cut {self.cut_time_s:.3f}s, "
            f"up to {self.concurrency_per_engine:.1f} episodes at once per engine ({self.engines} engines), "
            f"measured step {self.step_time_s:.3f}s{self.describe_images()}"
        )


def _q(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def read_profile(run_dir: Path, *, warmup: int = WARMUP_STEPS) -> Profile:
    """The steady-state figures of the run in `run_dir` (module docstring). Raises ValueError naming the
    file when the run has no steady state to read."""
    metrics = run_dir / "metrics"
    orch = [m for m in read_jsonl(metrics / "orchestrator.jsonl") if m["step"] >= warmup]
    trainer = [m for m in read_jsonl(metrics / "trainer.jsonl") if m["step"] >= warmup]
    if not orch or not trainer:
        raise ValueError(
            f"{metrics}: no orchestrator/trainer steps after the first {warmup} (a run of at least "
            f"{warmup + 3} steps is needed to profile)"
        )
    start = min(m["time"] for m in trainer) - _median([m["time/step"] for m in orch])
    episodes = [
        e for e in read_jsonl(metrics / "episodes.jsonl") if e["status"] == "ok" and e["time"] >= start
    ]
    if not episodes:
        raise ValueError(f"{metrics / 'episodes.jsonl'}: no ok episode finished after the warm-up")
    engines = _engines(run_dir)
    concurrency = _peak_concurrency(episodes) / engines
    updates = [m["time/sync_weights"] for m in orch if m.get("time/sync_weights", 0) > 0]
    return Profile(
        run_dir=run_dir,
        steps=len(orch) + warmup,
        latency_groups=_by_group(episodes),
        train_time_s=_median([m["time/train"] for m in trainer])
        + min(m.get("time/publish_weights", 0.0) for m in trainer),
        write_time_s=_median([m["time/write_weights"] for m in trainer if "time/write_weights" in m]),
        update_time_s=_median(updates),
        cut_time_s=_median([m.get("time/cut", 0.0) for m in orch]),
        step_time_s=statistics.fmean(m["time/step"] for m in orch),
        engines=engines,
        concurrency_per_engine=max(1.0, concurrency),
        vision_time_s=_median([m["inference/vision_s"] for m in orch if "inference/vision_s" in m]),
        images_per_episode=_mean(
            [m["rollout/images_per_episode"] for m in orch if "rollout/images_per_episode" in m]
        ),
        episodes_per_step=len(episodes) / len(orch),
    )


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def _by_group(episodes: list[dict]) -> tuple[tuple[float, ...], ...]:
    groups: dict[object, list[float]] = {}
    for e in episodes:
        groups.setdefault(e.get("group", id(e)), []).append(e["seconds"])
    return tuple(tuple(v) for v in groups.values())


def _peak_concurrency(episodes: list[dict]) -> int:
    """Most episodes running at once: each one spans [time - seconds, time] (`time` is when its group was
    logged, so the span is shifted late by at most the group's tail)."""
    events = sorted(
        [(e["time"] - e["seconds"], 1) for e in episodes] + [(e["time"], -1) for e in episodes],
        key=lambda ev: (ev[0], ev[1]),
    )
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def _engines(run_dir: Path) -> int:
    """Inference engines of the run, from its resolved `configs/orchestrator.toml` (1 when absent)."""
    path = run_dir / "configs" / "orchestrator.toml"
    if not path.exists():
        return 1
    urls = tomllib.loads(path.read_text()).get("inference", {}).get("base_urls", [])
    return max(1, len(urls))


def profile_run(rl_argv: list[str], *, steps: int, run_dir: Path, timeout_s: float) -> Path:
    """Run `rl` with the user's arguments for `steps` steps into `run_dir` (wandb off); return `run_dir`."""
    seconds = run_rl(rl_argv, steps=steps, run_dir=run_dir, timeout_s=timeout_s, caller="plan")
    print(f"plan: profile run of {steps} steps took {seconds:.0f}s", flush=True)
    return run_dir
