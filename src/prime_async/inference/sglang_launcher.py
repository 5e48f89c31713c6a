"""Launch SGLang server(s) for `backend = "sglang"`: build the command lines, start, wait, forward logs, stop.

Called by `inference/server.py:run` (and by the GPU conformance tests). `sglang` is an optional extra
(`uv sync --extra sglang`); nothing here imports it, so command lines are built and tested anywhere.

Engine i of `sglang.num_engines` serves on `server.port + i` with GPUs `gpu_ids[i*tp*dp:(i+1)*tp*dp]`
(via CUDA_VISIBLE_DEVICES, translated through this process's own: `rl` gives the inference process
`gpus.inference`, and `gpu_ids` index those). Flags an RL run needs: `--weight-version` (so `/generate`
stamps tokens with our integer versions), `--skip-server-warmup`, `--context-length = seq_len`,
`--random-seed`, bound to 127.0.0.1 unless configured otherwise (then `--api-key` is required by config
validation). With `lora`: `--enable-lora --max-lora-rank --lora-target-modules --max-loaded-loras
--max-loras-per-batch`.

Invariants: `stop()` ends every process it started (SIGTERM to its process group, SIGKILL after a
timeout); `wait_ready` fails with RuntimeError naming the engine as soon as one exits during startup.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from prime_async.config.inference import InferenceConfig
from prime_async.config.placement import child_visible_devices
from prime_async.utils.process_tree import descendants, die_with_parent, kill_tree

logger = logging.getLogger(__name__)


@dataclass
class LaunchSpec:
    """One SGLang server: its argv, extra environment and URL."""

    argv: list[str]
    env: dict[str, str]
    url: str


def build_launch_specs(cfg: InferenceConfig, environ: Mapping[str, str] | None = None) -> list[LaunchSpec]:
    """The `python -m sglang.launch_server ...` command of every engine (pure: tested on CPU).

    `gpu_ids` index the devices this process sees: under a CUDA_VISIBLE_DEVICES of its own (`environ`,
    default `os.environ`; `rl` sets it) engine i's value is taken from that list, since a child's
    CUDA_VISIBLE_DEVICES replaces its parent's rather than narrowing it."""
    environ = os.environ if environ is None else environ
    sg, srv = cfg.sglang, cfg.server
    gpus_per_engine = sg.tp * sg.dp
    gpu_ids = sg.gpu_ids if sg.gpu_ids is not None else list(range(sg.num_engines * gpus_per_engine))
    if len(gpu_ids) < sg.num_engines * gpus_per_engine:
        raise ValueError(
            f"sglang.gpu_ids has {len(gpu_ids)} GPUs; num_engines * tp * dp = "
            f"{sg.num_engines * gpus_per_engine} are needed"
        )
    specs = []
    for i in range(sg.num_engines):
        port = srv.port + i
        argv = [
            sg.python, "-m", "sglang.launch_server",
            "--model-path", cfg.model.path,
            "--host", srv.host,
            "--port", str(port),
            "--tp-size", str(sg.tp),
            "--dp-size", str(sg.dp),
            "--mem-fraction-static", str(sg.mem_fraction),
            "--context-length", str(cfg.seq_len),
            "--dtype", cfg.model.dtype,
            "--random-seed", str(cfg.engine.seed),
            "--weight-version", str(cfg.weight_version),
            "--log-level", cfg.log.level.lower(),
            "--skip-server-warmup",
        ]  # fmt: skip
        if sg.max_running_requests is not None:
            argv += ["--max-running-requests", str(sg.max_running_requests)]
        if srv.api_key:
            argv += ["--api-key", srv.api_key]
        if cfg.deterministic:  # batch-invariant kernels; `sampling_seed` per request
            argv += ["--enable-deterministic-inference"]
        if cfg.router_replay:  # `routed_experts` in every answer that asks (MoE routing replay)
            argv += ["--enable-return-routed-experts"]
        argv += lora_flags(cfg)
        argv += list(sg.extra_args)
        gpus = gpu_ids[i * gpus_per_engine : (i + 1) * gpus_per_engine]
        env = {"CUDA_VISIBLE_DEVICES": child_visible_devices(environ.get("CUDA_VISIBLE_DEVICES"), gpus)}
        host = "127.0.0.1" if srv.host in ("0.0.0.0", "::") else srv.host
        specs.append(LaunchSpec(argv=argv, env=env, url=f"http://{host}:{port}"))
    return specs


def lora_flags(cfg: InferenceConfig) -> list[str]:
    """SGLang's dynamic-LoRA flags for `cfg.lora` (none without it): adapters are loaded at run time, so
    the rank bound and the target modules are given up front; the newest adapter and the ones still in
    use by running requests must fit in one batch."""
    if cfg.lora is None:
        return []
    modules = sorted({m.rsplit(".", 1)[-1] for m in cfg.lora.target_modules})
    n = str(cfg.max_loaded_loras)
    return [
        "--enable-lora", "--max-lora-rank", str(cfg.lora.rank), "--lora-target-modules", *modules,
        "--max-loaded-loras", n, "--max-loras-per-batch", n,
    ]  # fmt: skip


class SGLangLauncher:
    """Starts the servers of `specs`, forwards their output to our log, stops them."""

    def __init__(self, *, specs: list[LaunchSpec], startup_timeout_s: float = 900.0):
        self.specs = specs
        self.startup_timeout_s = startup_timeout_s
        self.procs: list[subprocess.Popen] = []
        self._threads: list[threading.Thread] = []

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.specs]

    def start(self) -> None:
        for i, spec in enumerate(self.specs):
            logger.info("starting sglang engine %d: %s", i, " ".join(spec.argv))
            proc = subprocess.Popen(
                spec.argv,
                env={**os.environ, **spec.env},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # own process group: stop() reaches its workers too
                preexec_fn=die_with_parent,  # SIGTERM to the server if this launcher is SIGKILLed
            )
            self.procs.append(proc)
            t = threading.Thread(target=_forward, args=(proc, i), name=f"sglang-log-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = dict(enumerate(self.specs))
        while pending:
            for i, spec in list(pending.items()):
                code = self.procs[i].poll()
                if code is not None:
                    raise RuntimeError(f"sglang engine {i} exited with code {code} during startup")
                if _healthy(spec.url):
                    logger.info("sglang engine %d ready at %s", i, spec.url)
                    del pending[i]
            if pending and time.monotonic() > deadline:
                raise RuntimeError(
                    f"sglang engines {sorted(pending)} not healthy after {self.startup_timeout_s}s"
                )
            if pending:
                time.sleep(1.0)

    def poll(self) -> int | None:
        """Index of the first engine that exited, else None."""
        for i, p in enumerate(self.procs):
            if p.poll() is not None:
                return i
        return None

    def stop(self, timeout_s: float = 30.0) -> None:
        """End every server and every process it started (scheduler, detokenizer), then reap the servers."""
        trees = {p.pid: tuple(descendants(p.pid)) for p in self.procs}  # before a server exits
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # tolerated: exited meanwhile
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            kill_tree(p.pid, timeout_s=timeout_s, also=trees[p.pid])
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("sglang pid %d did not stop in %.0fs; killing", p.pid, timeout_s)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def _forward(proc: subprocess.Popen, index: int) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        logger.info("[sglang %d] %s", index, line.rstrip())


def run_sglang(cfg: InferenceConfig) -> None:
    """Start every engine, wait for /health, then block until one exits or we are interrupted."""
    import importlib.util
    import sys

    if cfg.sglang.python in ("python", sys.executable) and importlib.util.find_spec("sglang") is None:
        raise ValueError("backend = 'sglang' needs the sglang extra: `uv sync --extra sglang`")
    launcher = SGLangLauncher(specs=build_launch_specs(cfg), startup_timeout_s=cfg.sglang.startup_timeout_s)
    # SIGTERM (what `rl` and most supervisors send) must unwind through `finally` so the servers stop too;
    # Python's default action would end this process at once and orphan them.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    launcher.start()
    try:
        launcher.wait_ready()
        logger.info("sglang engines ready: %s", ", ".join(launcher.urls))
        while (dead := launcher.poll()) is None:
            time.sleep(2.0)
        raise RuntimeError(f"sglang engine {dead} exited with code {launcher.procs[dead].returncode}")
    finally:
        launcher.stop()
