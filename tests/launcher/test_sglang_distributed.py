"""`rl` on real SGLang with `weights.transport = "distributed"`: the trainer is rank 0 of SGLang's own
weight-update process group (`/init_weights_update_group`, `/update_weights_from_distributed`).

- CPU (slow): SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`, the stand-in `sgl_kernel` of
  `scripts/sglang_cpu/`), gloo; 3 steps with in-flight updates.
- GPU (gpu, run by scripts/gpu_smoke.sh): SGLang on CUDA, the trainer on CUDA, NCCL.
Both check that every version after v0 reached SGLang over the group (its weight version advances while
the broadcast directory holds only the last step) and that the trainer's logprobs stay close to SGLang's.
Skipped unless the sglang extra is installed.
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


def run_rl(out: Path, model_dir: Path, *extra: str, env: dict[str, str], overlay: str | None = None) -> None:
    files = ["@", str(ROOT / "configs/tiny/rl.toml"), *(["@", str(ROOT / overlay)] if overlay else [])]
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.rl", *files,
        "--output-dir", str(out), "--model.path", str(model_dir), "--max-steps", "3",
        "--inference.backend", "sglang", "--inference.sglang.python", sys.executable,
        "--inference.server.port", "0", "--transport.port", "0", "--weights.master-port", "0",
        "--weights.transport", "distributed", "--weights.bucket-mb", "1",
        "--inference.sglang.mem-fraction", "0.2", *extra,  # 0.05 fails when other processes hold the RAM
    ]  # fmt: skip
    run_leaving_nothing(cmd, out, env)


def check_run(out: Path, backend: str) -> None:
    orch = [json.loads(line) for line in (out / "metrics" / "orchestrator.jsonl").read_text().splitlines()]
    assert [m["step"] for m in orch] == [0, 1, 2]
    assert orch[-1]["weights/served_version"] >= 1
    assert sum(m["weights/updates"] for m in orch) >= 1
    assert sorted(p.name for p in (out / "broadcasts").glob("step_*")) == ["step_3"]
    orch_log = (out / "logs" / "orchestrator.log").read_text()
    assert f"1 engine(s), {backend} on 127.0.0.1" in orch_log
    trainer = [json.loads(line) for line in (out / "metrics" / "trainer.jsonl").read_text().splitlines()]
    assert len(trainer) == 3 and all(m["mismatch_kl"] < 0.05 for m in trainer), trainer


@pytest.mark.timeout(900)
def test_rl_distributed_on_real_sglang_cpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_rl(out, tiny_model_dir, env=cpu_sglang_env(), overlay="configs/tiny/rl_sglang_cpu.toml")
    check_run(out, "gloo")


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_rl_distributed_on_real_sglang_gpu_nccl(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    extra = ["--model.dtype", "float32",
             "--inference.sglang.extra-args", '["--attention-backend", "torch_native"]']  # fmt: skip
    run_rl(out, tiny_model_dir, *extra, env={})
    check_run(out, "nccl")
