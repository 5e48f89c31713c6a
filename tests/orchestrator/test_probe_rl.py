"""The check after every weight load in a real tiny run (`rl`: embedded engine, trainer, orchestrator):
every window that loaded a version logs `weights/probe_*` below the thresholds, and no ERROR line."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest

import zygote
from prime_async.config.probe import WeightProbeConfig
from proc_helpers import free_port, read_jsonl

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_normal_tiny_run_passes_the_weight_probe_at_every_version(tiny_model_dir: Path, tmp_path: Path):
    out, steps = tmp_path / "run", 4
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(ROOT / "configs/tiny/rl.toml"),
        "--output-dir", str(out), "--model.path", str(tiny_model_dir), "--max-steps", str(steps),
        "--inference.server.port", str(free_port()), "--transport.port", str(free_port()),
        "--weights.probe.enabled", "true",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline"}
    proc = zygote.run(cmd, cwd=ROOT, env=env, timeout=840)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((out / "logs").glob("*.log")))
    assert proc.returncode == 0, f"rl exited {proc.returncode}:\n{proc.stderr[-3000:]}\n{logs}"

    limits = WeightProbeConfig()
    orch = read_jsonl(out / "metrics" / "orchestrator.jsonl")
    loaded = [m for m in orch if m["weights/updates"] > 0]
    assert loaded, "no weight version was loaded"
    text = (out / "logs" / "orchestrator.log").read_text()
    assert text.count("weights v") and "weight probe:" not in text
    # the check runs after a load, concurrently with the batch that may cut the row: a load's figures are
    # in its row or the next one (a load after the last row shows in none)
    checked = [m for m in orch if "weights/probe_max_abs_logprob_diff" in m]
    steps = {m["step"] for m in checked}
    late = [m["step"] for m, after in itertools.pairwise(orch)
            if m["weights/updates"] > 0 and not {m["step"], after["step"]} & steps]  # fmt: skip
    assert checked and not late, f"versions loaded at steps {late} were never checked by the weight probe"
    for m in checked:
        print({k: v for k, v in m.items() if k.startswith("weights/probe_")} | {"step": m["step"]})
        assert m["weights/probe_max_abs_logprob_diff"] <= limits.max_logprob_diff
        assert m["weights/probe_kl"] <= limits.max_kl and m["weights/probe_tv"] <= limits.max_tv
        assert m["weights/probe_time_s"] > 0
