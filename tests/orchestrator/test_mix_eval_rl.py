"""Two environments at 3:1 and a held-out eval environment through `rl` (three real processes, tiny
model, CPU): `configs/tiny/rl_mix.toml`, 6 steps, eval shared on the training engines (default suite)
and on a second embedded engine that `rl` launches (dedicated, `slow`).

Checked from the JSONL files the processes write: both environments' rewards; the trained mix within
one group of 3:1; eval at version 0, at the interval and at the end, each with the version it ran at and
no token of another version; and the ledger balancing with eval excluded (it counts training
trajectories only: 6 batches x 4 groups x 2 episodes trained, eval episodes nowhere).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from test_env_kinds_rl import BUCKETS, free_port, read_jsonl

import zygote

ROOT = Path(__file__).resolve().parents[2]
STEPS, BATCH_GROUPS, GROUP_SIZE = 6, 4, 2


def run_mix(tmp_path: Path, model_dir: Path, *extra: str, timeout: int) -> Path:
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(ROOT / "configs/tiny/rl_mix.toml"),
        "--output-dir", str(out), "--model.path", str(model_dir),
        "--inference.server.port", str(free_port()), "--transport.port", str(free_port()), *extra,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline"}
    proc = zygote.run(cmd, cwd=ROOT, env=env, timeout=timeout)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((out / "logs").glob("*.log")))
    assert proc.returncode == 0, f"rl exited {proc.returncode}:\n{proc.stderr[-3000:]}\n{logs}"
    return out


def check_training(out: Path) -> None:
    orch = read_jsonl(out / "metrics" / "orchestrator.jsonl")
    assert [m["step"] for m in orch] == list(range(STEPS))
    for m in orch:
        assert m["ledger/dispatched"] == sum(m[f"ledger/{b}"] for b in BUCKETS)
        assert m["rollout/env/reverse-text/trained_groups"] + m["rollout/env/calculator/trained_groups"] == 4
    assert orch[-1]["ledger/trained"] == STEPS * BATCH_GROUPS * GROUP_SIZE  # eval episodes are not in it
    for name in ("reverse-text", "calculator"):
        assert any(f"reward/{name}/mean" in m for m in orch), f"no reward of {name}"
    calculator = sum(m["rollout/env/calculator/trained_groups"] for m in orch)
    assert abs(calculator - STEPS * BATCH_GROUPS / 4) <= 1, f"{calculator} calculator groups of 24"
    assert orch[-1]["env/calculator/episodes/ok"] > 0 and orch[-1]["env/reverse-text/episodes/ok"] > 0


def check_eval(out: Path, *, exact_interval: bool) -> None:
    evals = read_jsonl(out / "metrics" / "eval.jsonl")
    versions = [int(m["eval/weight_version"]) for m in evals]
    assert [m["step"] for m in evals] == versions  # logged against the version
    if exact_interval:
        assert versions == [0, 3, STEPS]
    else:  # shared: the interval eval runs at the first version served at or after 3
        assert versions[0] == 0 and versions[-1] == STEPS and len(versions) == 3 and 3 <= versions[1] < STEPS
    for m, version in zip(evals, versions, strict=True):
        assert m["eval/reverse-text-heldout/num_episodes"] == 16  # 8 examples x 2 rollouts
        assert m["eval/reverse-text-heldout/off_version_tokens"] == 0
        assert 0 <= m["eval/reverse-text-heldout/reward/mean"] <= 1
        assert 0 <= m["eval/reverse-text-heldout/pass@2"] <= 1
        lines = (out / "eval" / f"samples_v{version}.jsonl").read_text().splitlines()
        samples = [json.loads(line) for line in lines]
        assert len(samples) == 16 and {s["version"] for s in samples} == {version}
        assert all(s["prompt"] and "reward" in s for s in samples)
    trainer = read_jsonl(out / "metrics" / "trainer.jsonl")
    assert [m["step"] for m in trainer] == list(range(STEPS))


@pytest.mark.timeout(600)
def test_two_envs_three_to_one_with_shared_eval(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = run_mix(tmp_path, tiny_model_dir, timeout=540)
    check_training(out)
    check_eval(out, exact_interval=False)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dedicated_eval_on_a_second_embedded_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = run_mix(
        tmp_path, tiny_model_dir, "--orchestrator.eval.placement", "dedicated",
        "--eval-inference.server.port", str(free_port()), timeout=840,
    )  # fmt: skip
    check_training(out)
    check_eval(out, exact_interval=True)
    log = (out / "logs" / "eval_inference.log").read_text()  # the eval engine loaded what it evaluated
    assert "step_3 as version 3" in log and f"step_{STEPS} as version {STEPS}" in log, log[-2000:]
