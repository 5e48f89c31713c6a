"""`doctor` as a user runs it: real processes (the embedded engine, a K = 0 `rl` run), the tiny model.

`configs/tiny/rl.toml` passes every check; the same config with a reward that ignores the episode (random)
and a `seq_len` too short for prompt + max_tokens fails exactly those two checks, exits 1 and prints the
fixes. Both leave no process behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import zygote
from prime_async.doctor.sync_run import run_k0
from prime_async.utils.monitor import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
BROKEN_REWARD = Path(__file__).parent / "random_reward.py"


def _doctor(
    tiny_model_dir: Path, out: Path, *extra: str, timeout: float = 600
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.doctor", "@", str(ROOT / "configs/tiny/rl.toml"),
        "--output-dir", str(out), "--model.path", str(tiny_model_dir), *extra,
        "--model.dtype", "float32",  # the logprob check's threshold is float32's ("auto": bf16 on CUDA)
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline"}
    return zygote.run(cmd, cwd=ROOT, env=env, timeout=timeout)


def _rows(stdout: str) -> dict[str, str]:
    """check name -> result, from the table's rows."""
    out = {}
    for line in stdout.splitlines():
        for status in ("pass", "FAIL", "skip"):
            if f"  {status}  " in line:
                out[line.split(f"  {status}  ")[0].split("  ", 1)[1].strip()] = status
    return out


@pytest.mark.timeout(700)
def test_doctor_passes_the_tiny_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    proc = _doctor(tiny_model_dir, tmp_path / "run", "--sync-steps", "2", "--examples", "3", "--longest", "1")
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rows = _rows(proc.stdout)
    assert rows == {
        "tokens round-trip": "pass", "same seed, same reward": "pass", "longest prompt fits seq_len": "pass",
        "longest episode fits seq_len": "pass", "engine vs trainer logprobs (v0)": "pass",
        "engine vs trainer full vocabulary (v0)": "pass", "K = 0 equals sync": "pass",
    }, proc.stdout  # fmt: skip
    assert (tmp_path / "run-doctor" / "k0-run" / "metrics" / "trainer.jsonl").exists()


@pytest.mark.timeout(700)
def test_doctor_flags_a_random_reward_and_a_short_seq_len(tiny_model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text(f'[orchestrator.env.args.task.rewards.lcs]\nfn = "{BROKEN_REWARD}:random_reward"\n')
    proc = _doctor(
        tiny_model_dir, tmp_path / "run", "@", str(broken), "--seq-len", "64", "--sync-steps", "0",
        "--examples", "2", "--longest", "1",
    )  # fmt: skip
    assert proc.returncode == 1, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rows = _rows(proc.stdout)
    assert rows["same seed, same reward"] == "FAIL" and rows["longest prompt fits seq_len"] == "FAIL"
    assert rows["tokens round-trip"] == "pass" and rows["K = 0 equals sync"] == "skip"
    assert "fix [reverse-text] same seed, same reward: make the reward a function of the task" in proc.stdout
    assert "raise seq_len to >=" in proc.stdout
    assert proc.stdout.rstrip().endswith("doctor: 2 check(s) failed")


@pytest.mark.timeout(500)
def test_k0_check_passes_two_optimizer_steps_per_batch(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The review's F3 run: K = 0 with `optim.num_steps_per_batch = 2` trains the second mini-batch one
    optimizer step after its tokens were sampled, by design; the check passes it (it used to FAIL it as a
    scheduler bug), and the trainer's rows show why: distance 1 at every step, none of unknown version."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.chdir(ROOT)
    argv = [
        "@", str(ROOT / "configs/tiny/rl.toml"), "--model.path", str(tiny_model_dir),
        "--orchestrator.batch-groups", "8", "--orchestrator.admission.max-buffered-groups", "8",
        "--trainer.optim.num-steps-per-batch", "2",
    ]  # fmt: skip
    result = run_k0(argv, tmp_path / "k0s2", steps=3, timeout_s=400)
    trainer = read_jsonl(tmp_path / "k0s2" / "metrics" / "trainer.jsonl")
    assert [(m["optim/num_steps"], m["offpolicy/effective_steps/max"]) for m in trainer] == [(2, 1)] * 3
    assert all(m["offpolicy/unknown_version_tokens"] == 0 < m["offpolicy/on_policy_tokens"] for m in trainer)
    assert result.passed is True, result
