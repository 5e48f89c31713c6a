"""A short `rl` run as a child process, for commands that measure or check a config (`plan`, `doctor`).

Invariant: the child never outlives the call: past `timeout_s` it is terminated (then killed) and the
error names the caller, the run and its log directory; a non-zero exit is an error naming the logs.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def run_rl(argv: list[str], *, steps: int, run_dir: Path, timeout_s: float, caller: str) -> float:
    """Run `rl` with the user's arguments for `steps` steps into `run_dir` (wandb off, free ports: a run
    of the same config may be going on); its seconds."""
    cmd = [sys.executable, "-m", "prime_async.entrypoints.rl", *argv, "--max_steps", str(steps),
           "--output_dir", str(run_dir), "--wandb.enabled", "false",
           "--inference.server.port", "0", "--transport.port", "0"]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen(cmd)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise RuntimeError(
            f"the rl run {caller} started ({steps} steps) did not finish in {timeout_s:.0f}s; {caller} "
            f"waited on it: see {run_dir}/logs"
        ) from None
    except BaseException:
        proc.terminate()
        proc.wait()
        raise
    if rc != 0:
        raise RuntimeError(f"the rl run {caller} started exited {rc}: see {run_dir}/logs")
    return time.monotonic() - started


RUN_FLAGS = (
    "--max_steps", "--max-steps", "--output_dir", "--output-dir", "--wandb.enabled",
    "--inference.server.port", "--transport.port",
)  # fmt: skip


def without_flags(argv: list[str], names: tuple[str, ...] = RUN_FLAGS) -> list[str]:
    """`argv` without the value flags `names` (`--name value` or `--name=value`): the child run sets them."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.split("=", 1)[0] in names:
            skip = "=" not in arg
        else:
            out.append(arg)
    return out


def fail(caller: str, error: Exception) -> None:
    """Exit 1 with one line naming the caller and the error (no traceback: the child's logs have it)."""
    print(f"{caller}: error: {error}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def sibling_dir(output_dir: Path, suffix: str) -> Path:
    """`<output_dir><suffix>`, or with a time stamp when that exists (an earlier one is never overwritten)."""
    base = Path(output_dir)
    run_dir = base.with_name(base.name + suffix)
    return run_dir if not run_dir.exists() else base.with_name(f"{base.name}{suffix}-{int(time.time())}")
