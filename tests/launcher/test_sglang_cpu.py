"""`rl` on real SGLang (CPU engine): 3 steps with in-flight weight updates from the filesystem under
`in_place` on a multi-turn environment, and no process of the run alive afterwards. SGLang's other pause
mode, `retract` (the default), runs on real SGLang in `test_sglang_distributed.py` (weights over
torch.distributed); `drain` needs no SGLang route and is covered by the embedded-engine runs. One SGLang
start-up per file: each costs 1-3 minutes of CPU, the longest waits of the suite.

Skipped unless the sglang extra is installed (`uv sync --extra sglang`). SGLang's CPU engine needs
`SGLANG_USE_CPU_ENGINE=1` and the stand-in `sgl_kernel` of `scripts/sglang_cpu/` first on PYTHONPATH.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from sglang_runs import cpu_sglang_env, run_leaving_nothing

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs the sglang extra"),
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("pause_mode", "env_id"), [("in_place", "calculator")])
def test_rl_on_real_sglang(tiny_model_dir: Path, tmp_path: Path, pause_mode: str, env_id: str) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(ROOT / "configs/tiny/rl.toml"),
        "@", str(ROOT / "configs/tiny/rl_sglang_cpu.toml"), "--output-dir", str(out),
        "--model.path", str(tiny_model_dir), "--max-steps", "3", "--inference.sglang.python", sys.executable,
        "--inference.server.port", "0", "--transport.port", "0", "--weights.pause-mode", pause_mode,
        "--orchestrator.env.id", env_id,
    ]  # fmt: skip
    run_leaving_nothing(cmd, out, cpu_sglang_env())
    inference_log = (out / "logs" / "inference.log").read_text()
    assert "sglang.launch_server" in inference_log
    orch = [json.loads(line) for line in (out / "metrics" / "orchestrator.jsonl").read_text().splitlines()]
    assert [m["step"] for m in orch] == [0, 1, 2]
    assert max(m["time/sync_weights"] for m in orch) > 0, "no in-flight weight update happened"
    assert all(m["rollout/data_staleness/min"] >= 0 and m["rollout/token_staleness/max"] <= 1 for m in orch)
    trainer = [json.loads(line) for line in (out / "metrics" / "trainer.jsonl").read_text().splitlines()]
    assert len(trainer) == 3 and all(m["mismatch_kl"] < 0.05 for m in trainer), trainer
