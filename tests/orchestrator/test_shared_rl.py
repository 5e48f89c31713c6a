"""`rl` with `weights.transport = "shared"` on CPU: every version reaches the engine through POSIX shared
memory (`/dev/shm`), no process group, no weight directory but the last step's.

Three real processes on the tiny model. Synchronous (K = 0): the trainer's logprobs of every batch equal
the engine's sampling logprobs (mismatch KL ~ 0), so after every shared-memory update the engine served
exactly the trainer's weights of that version (`tests/inference/test_distributed_weights.py` compares the
path bit for bit with the filesystem one). In flight (K = 2, in_place): versions load while generation is
paused mid-request. Either way no segment is left in /dev/shm once the run ended.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import zygote
from prime_async.weights.shared_memory import shm_dir
from proc_helpers import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
SHARED = ["--weights.transport", "shared", "--trainer.runtime.mem-fraction", "0.5",
          "--inference.engine.mem-fraction", "0.4"]  # fmt: skip


def run_rl(out: Path, model_dir: Path, *extra: str, steps: int) -> None:
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(ROOT / "configs/tiny/rl.toml"),
        "--output-dir", str(out), "--model.path", str(model_dir), "--max-steps", str(steps),
        "--inference.server.port", "0", "--transport.port", "0", *SHARED, *extra,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline"}
    proc = zygote.run(cmd, cwd=ROOT, env=env, timeout=840)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((out / "logs").glob("*.log")))
    assert proc.returncode == 0, f"rl exited {proc.returncode}:\n{proc.stderr[-3000:]}\n{logs}"


def loaded_versions(out: Path) -> list[str]:
    """Versions the engine copied from shared memory, in order (its log line per load)."""
    lines = (out / "logs" / "inference.log").read_text().splitlines()
    return [line.rsplit("as version ", 1)[1] for line in lines if "tensors from shared memory (v" in line]


def segments() -> set[str]:
    return {p.name for p in shm_dir().glob("prime-async-*")}


@pytest.mark.timeout(900)
def test_rl_shared_sync_logprobs_match_trainer(tiny_model_dir: Path, tmp_path: Path):
    before = segments()
    out, steps = tmp_path / "run", 4
    run_rl(out, tiny_model_dir, "--orchestrator.max-off-policy-steps", "0", steps=steps)
    trainer = read_jsonl(out / "metrics" / "trainer.jsonl")
    assert [m["step"] for m in trainer] == list(range(steps))
    for m in trainer:  # batch n was sampled under v_n, copied from shared memory for n >= 1
        assert m["mismatch_kl"] < 1e-9, m
    assert loaded_versions(out) == [str(v) for v in range(1, steps)]
    orch = read_jsonl(out / "metrics" / "orchestrator.jsonl")
    assert [m["weights/served_version"] for m in orch][-1] == steps - 1
    assert sum(m["time/sync_weights"] for m in orch) > 0
    assert sorted(p.name for p in (out / "broadcasts").glob("step_*")) == [f"step_{steps}"]
    assert segments() <= before, "the trainer left shared-memory segments"


@pytest.mark.timeout(900)
def test_rl_shared_in_flight_updates(tiny_model_dir: Path, tmp_path: Path):
    out, steps, k = tmp_path / "run", 6, 2
    run_rl(
        out, tiny_model_dir, "--weights.pause-mode", "in_place", "--orchestrator.max-off-policy-steps",
        str(k), "--orchestrator.admission.max-buffered-groups", "4",
        "--orchestrator.sampling.max-tokens", "128",
        steps=steps,
    )  # fmt: skip
    orch = read_jsonl(out / "metrics" / "orchestrator.jsonl")
    assert [m["step"] for m in orch] == list(range(steps))
    assert all(m["rollout/token_staleness/max"] <= k for m in orch)
    assert sum(m["weights/updates"] for m in orch) >= 2
    assert sum(m["weights/inflight_groups_at_update"] for m in orch) > 0, "no update happened in flight"
    served = [m["weights/served_version"] for m in orch]
    assert served == sorted(served) and served[-1] >= steps - 1 - k
    assert str(int(served[-1])) in loaded_versions(out)
