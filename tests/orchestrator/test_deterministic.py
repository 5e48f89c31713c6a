"""`deterministic = true` end to end: real `rl` runs (embedded engine, orchestrator, trainer processes)
on the tiny model, compared bit for bit.

- Two runs of `configs/tiny/rl.toml` (K = 1), started at the same time so that they compete for the
  CPU and their timings differ: the same rewards, losses and trainer metrics at every step and the
  same bytes in the final published weights. Both distil from a teacher as well (the initial model,
  added to the environment's advantage), so the teacher's scores are reproducible too.
- `rl.toml` at K = 0 against its synchronous twin `configs/tiny/rl_sync.toml`, the latter also forced to
  run one group at a time: equal step for step.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import zygote

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
# What a batch is made of (the orchestrator's other metrics are snapshots of queues at logging time).
_BATCH = ("step", "reward/", "rollout/data_staleness/", "rollout/trained_", "rollout/truncated_fraction",
          "rollout/version_span/", "rollout/queue_steps/", "ledger/trained", "opd/")  # fmt: skip
_TIMING = ("time", "perf/")  # the trainer's timings; everything else it logs must be equal


def _start(config: str, out: Path, model: Path, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(ROOT / "configs/tiny" / config),
        "--deterministic", "true", "--output-dir", str(out), "--model.path", str(model),
        "--max-steps", str(STEPS), "--inference.server.port", "0", "--transport.port", "0", *extra,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline"}
    pipe = subprocess.PIPE
    return zygote.popen(cmd, cwd=ROOT, env=env, stdout=pipe, stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen, out: Path) -> None:
    try:
        output, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.terminate()
        output, _ = proc.communicate(timeout=60)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((out / "logs").glob("*.log")))
    assert proc.returncode == 0, f"rl exited {proc.returncode}:\n{output[-3000:]}\n{logs}"


def run_pair(tmp_path: Path, model: Path, a: tuple[str, ...], b: tuple[str, ...]) -> tuple[Path, Path]:
    """Both runs at once (they share the CPU, so their timings differ)."""
    outs = tmp_path / "a", tmp_path / "b"
    procs = [_start(*args[:1], out, model, *args[1:]) for args, out in zip((a, b), outs, strict=True)]
    for proc, out in zip(procs, outs, strict=True):
        _wait(proc, out)
    return outs


def _metrics(out: Path, component: str) -> list[dict[str, float]]:
    lines = (out / "metrics" / f"{component}.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    if component == "orchestrator":
        return [{k: v for k, v in row.items() if k.startswith(_BATCH)} for row in rows]
    return [{k: v for k, v in row.items() if not k.startswith(_TIMING)} for row in rows]


def _weights_hash(out: Path, version: int) -> str:
    files = sorted((out / "broadcasts" / f"step_{version}").glob("*.safetensors"))
    assert files, f"no published weights of version {version} in {out}"
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


def assert_identical(a: Path, b: Path) -> None:
    for component in ("orchestrator", "trainer"):
        ma, mb = _metrics(a, component), _metrics(b, component)
        assert [m["step"] for m in ma] == list(range(STEPS))
        for row_a, row_b in zip(ma, mb, strict=True):
            diff = {k: (row_a.get(k), row_b.get(k)) for k in row_a.keys() | row_b.keys()
                    if row_a.get(k) != row_b.get(k)}  # fmt: skip
            assert not diff, f"{component} step {row_a['step']} differs: {diff}"
    for version in range(STEPS - 1, STEPS + 1):  # the trainer keeps the newest broadcasts
        assert _weights_hash(a, version) == _weights_hash(b, version), f"weights v{version} differ"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_deterministic_runs_are_bit_identical(tiny_model_dir: Path, tmp_path: Path):
    teacher = ("--orchestrator.teacher.model", str(tiny_model_dir), "--orchestrator.teacher.env-weight", "1")
    a, b = run_pair(tmp_path, tiny_model_dir, ("rl.toml", *teacher), ("rl.toml", *teacher))
    assert_identical(a, b)
    orch = _metrics(a, "orchestrator")
    assert all("opd/reverse_kl" in m for m in orch) and len({m["opd/reverse_kl"] for m in orch}) > 1
    assert [m["rollout/data_staleness/max"] for m in orch] == [0, 1, 1, 1]  # really K = 1: batch n at v_{n-1}
    assert len({m["reward/mean"] for m in orch}) > 1  # a real run, not constant output
    trainer = _metrics(a, "trainer")
    assert all(m["loss/num_loss_tokens"] > 0 for m in trainer)
    assert _weights_hash(a, STEPS) != _weights_hash(a, STEPS - 1)  # training changed the weights


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_k0_deterministic_equals_sync_step_for_step(tiny_model_dir: Path, tmp_path: Path):
    async_k0 = ("rl.toml", "--orchestrator.max-off-policy-steps", "0")
    sync_one_at_a_time = (
        "rl_sync.toml", "--orchestrator.admission.max-inflight-groups", "1",
        "--orchestrator.admission.submission-granularity", "group",
    )  # fmt: skip
    a, b = run_pair(tmp_path, tiny_model_dir, async_k0, sync_one_at_a_time)
    assert_identical(a, b)
    orch = _metrics(a, "orchestrator")
    assert all(m["rollout/data_staleness/max"] == 0 for m in orch)  # on-policy: batch n at v_n
