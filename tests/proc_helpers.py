"""Helpers of the tests that start real processes: free loopback ports, engine health, metrics files.

Imported by name (`from proc_helpers import free_port`): `tests/` is on `sys.path` through its
`conftest.py`. Ports are picked at random below the kernel's ephemeral range, as `rl` picks them, so no
process is handed one by the kernel between the probe and its use.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

import zygote
from prime_async.launcher.identity import free_ports


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (picked as `rl` picks its ports)."""
    return free_ports("127.0.0.1", 1)


def free_pair() -> int:
    """A port p with p + 1 free as well (the batch channel and the control channel next to it)."""
    return free_ports("127.0.0.1", 2)


def read_jsonl(path: Path) -> list[dict]:
    """The records of a metrics JSONL file; [] while the file does not exist yet."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_healthy(
    url: str,
    proc: zygote.Process | None,
    log: Path | None = None,
    timeout_s: float = 180,
) -> None:
    """Wait until `url/health` answers 200; fail at once, with the log's tail, if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
            raise AssertionError(f"engine at {url} exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):  # still starting
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.3)
    raise AssertionError(f"engine at {url} not healthy after {timeout_s} s")


def start_embedded_engine(config_toml: str, work: Path, timeout_s: float) -> tuple[str, zygote.Process]:
    """Start `inference @ work/inference.toml` (`config_toml` plus a free `[server] port`), logging to
    `work/engine.log`; returns its URL and process once healthy (the process is killed if it never is)."""
    port = free_port()
    cfg = work / "inference.toml"
    cfg.write_text(f"{config_toml}\n[server]\nport = {port}\n")
    log = work / "engine.log"
    with log.open("w") as fh:
        proc = zygote.popen(
            [sys.executable, "-m", "prime_async.entrypoints.inference", "@", str(cfg)],
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log, timeout_s=timeout_s)
    except BaseException:
        proc.kill()
        raise
    return url, proc
