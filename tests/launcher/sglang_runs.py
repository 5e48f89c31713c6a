"""`rl` runs on real SGLang for the tests: the CPU engine's environment and one run that must exit 0 with no
process of it left (found by a marker in their environment, `test_lifecycle._marked_processes`)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from test_lifecycle import MARK, _marked_processes

import zygote

ROOT = Path(__file__).resolve().parents[2]


def cpu_sglang_env() -> dict[str, str]:
    """SGLang's CPU engine: `SGLANG_USE_CPU_ENGINE=1` and the stand-in `sgl_kernel` first on PYTHONPATH."""
    return {
        "SGLANG_USE_CPU_ENGINE": "1",
        "PYTHONPATH": f"{ROOT / 'scripts' / 'sglang_cpu'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }


def run_leaving_nothing(cmd: list[str], out: Path, env: dict[str, str]) -> None:
    """Run `cmd` (an `rl` writing to `out`) to its end; assert exit 0 and that none of its processes
    outlived it (killing any that did, with their logs' tails in the failure)."""
    mark = uuid.uuid4().hex
    proc = zygote.run(cmd, cwd=ROOT, env={**os.environ, **env, MARK: mark}, timeout=840)
    survivors = _marked_processes(mark)
    for pid, _ in survivors:
        os.kill(pid, 9)
    logs = {p.stem: p.read_text()[-2500:] for p in (out / "logs").glob("*.log")}
    assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n{logs}"
    assert not survivors, f"processes of the run outlived it: {survivors}"
