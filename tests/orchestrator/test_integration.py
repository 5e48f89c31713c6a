"""The orchestrator as a real process with the embedded engine and a real trainer on the tiny model.

Started through `rl` (three real processes: inference, trainer, orchestrator) on free ports, once per
pause mode, with completions long enough that generation is still in flight when new weights arrive.
Checked from the metrics JSONL the processes write: every step produced, staleness <= K, the ledger
balances, weights were loaded into the engine in flight, and the trainer published every version.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import zygote
from proc_helpers import free_port, read_jsonl

ROOT = Path(__file__).resolve().parents[2]
BUCKETS = ("inflight", "buffered", "trained", "dropped_stale", "filtered", "errored", "cancelled")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("pause_mode", ["retract", "in_place", "drain"])
def test_rl_run_with_in_flight_updates(pause_mode: str, tiny_model_dir: Path, tmp_path: Path):
    # K=1 would cancel every group in flight at the cut. 6 steps: the batch of step 5 needs version >= 3
    # (staleness <= K), so at least two loads happen whatever the timing (4 steps guaranteed only one).
    out, steps, k = tmp_path / "run", 6, 2
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(ROOT / "configs/tiny/rl.toml"),
        "--output-dir", str(out), "--model.path", str(tiny_model_dir), "--max-steps", str(steps),
        "--inference.server.port", str(free_port()), "--transport.port", str(free_port()),
        "--weights.pause-mode", pause_mode, "--orchestrator.max-off-policy-steps", str(k),
        "--orchestrator.admission.max-buffered-groups", "4", "--orchestrator.sampling.max-tokens", "128",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline"}
    proc = zygote.run(cmd, cwd=ROOT, env=env, timeout=840)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((out / "logs").glob("*.log")))
    assert proc.returncode == 0, f"rl exited {proc.returncode}:\n{proc.stderr[-3000:]}\n{logs}"

    orch = read_jsonl(out / "metrics" / "orchestrator.jsonl")
    assert [m["step"] for m in orch] == list(range(steps))
    for m in orch:
        assert m["rollout/token_staleness/max"] <= k
        assert m["ledger/dispatched"] == sum(m[f"ledger/{b}"] for b in BUCKETS)
        assert m["rollout/trained_groups"] == 2
    # drain loads the trainer's newest version once nothing is in flight: it may skip versions
    assert sum(m["weights/updates"] for m in orch) >= (1 if pause_mode == "drain" else 2)
    assert sum(m["weights/inflight_groups_at_update"] for m in orch) > 0, "no update happened in flight"
    trainer = read_jsonl(out / "metrics" / "trainer.jsonl")
    assert [m["step"] for m in trainer] == list(range(steps))
    assert (out / "broadcasts" / f"step_{steps}" / "STABLE").is_file()  # older ones: trainer retention
    served = [m["weights/served_version"] for m in orch]
    assert served == sorted(served) and served[-1] >= steps - 1 - k
    text = (out / "logs" / "orchestrator.log").read_text()
    assert f"({pause_mode})" in text  # the watcher's "weights vN loaded into 1 engine(s) (<mode>)" line
