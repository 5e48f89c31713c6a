"""Each kind of verifiers environment trains through `rl` (three real processes, tiny model, CPU).

Kinds: single-turn (`reverse-text`), multi-turn against a scripted user (`word-chain` with
`opponent = "script"`), two seats (`word-chain`: one trained trajectory per seat, per-seat
advantages), and an infinite taskset (`word-chain`'s is infinite: streamed, never materialised).
Every kind on the default runner `inprocess`; through `env_server` (slow: a verifiers process per env) the
two-seat infinite kind, which exercises the most of that path (several seats, streamed tasks, multi-turn).
(Error visibility is tested in-process, faster: tests/environments/test_episode_errors.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import zygote
from proc_helpers import free_port, read_jsonl

ROOT = Path(__file__).resolve().parents[2]
BUCKETS = ("inflight", "buffered", "trained", "dropped_stale", "filtered", "errored", "cancelled")
KINDS = {
    "single_turn": {"id": "reverse-text", "args": {"num_examples": 64}},
    "multi_turn_scripted_user": {"id": "word-chain", "config": {"opponent": "script", "rounds": 2}},
    "two_seat_infinite": {"id": "word-chain", "config": {"rounds": 1}},
}


def rl(tmp_path: Path, model_dir: Path, env: dict, *extra: str, steps: int = 2, timeout: int = 300):
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(ROOT / "configs/tiny/rl.toml"),
        "--output-dir", str(out), "--model.path", str(model_dir), "--max-steps", str(steps),
        "--inference.server.port", str(free_port()), "--transport.port", str(free_port()),
        "--orchestrator.env", json.dumps(env), "--orchestrator.sampling.max-tokens", "8", *extra,
    ]  # fmt: skip
    env_vars = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline"}
    proc = zygote.run(cmd, cwd=ROOT, env=env_vars, timeout=timeout)
    return proc, out


def check_trained(proc: subprocess.CompletedProcess, out: Path, *, steps: int, seats: int) -> None:
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((out / "logs").glob("*.log")))
    assert proc.returncode == 0, f"rl exited {proc.returncode}:\n{proc.stderr[-3000:]}\n{logs}"
    orch = read_jsonl(out / "metrics" / "orchestrator.jsonl")
    assert [m["step"] for m in orch] == list(range(steps))
    for m in orch:
        assert m["ledger/dispatched"] == sum(m[f"ledger/{b}"] for b in BUCKETS)
        assert m["rollout/trained_groups"] == 2
    # the ledger counts trajectories: each trained group = group_size episodes x trained seats
    assert orch[-1]["ledger/trained"] == steps * 2 * 2 * seats
    if seats == 2:
        assert all("reward/seat/first/mean" in m and "reward/seat/second/mean" in m for m in orch)
    trainer = read_jsonl(out / "metrics" / "trainer.jsonl")
    assert [m["step"] for m in trainer] == list(range(steps))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", list(KINDS))
def test_env_kind_trains_inprocess(kind: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    proc, out = rl(tmp_path, tiny_model_dir, KINDS[kind])
    check_trained(proc, out, steps=2, seats=2 if kind == "two_seat_infinite" else 1)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["two_seat_infinite"])  # the env_server path is the same for every kind
def test_env_kind_trains_env_server(kind: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {**KINDS[kind], "runner": "env_server"}
    proc, out = rl(tmp_path, tiny_model_dir, env, timeout=840)
    check_trained(proc, out, steps=2, seats=2 if kind == "two_seat_infinite" else 1)


@pytest.mark.timeout(400)
def test_a_seat_without_a_turn_trains_the_seat_that_acted(tiny_model_dir: Path, tmp_path: Path) -> None:
    """word-chain with `forfeit`: an opening move that does not parse as a word ends the game, so `second`
    never acts (the tiny model's replies rarely parse). Its trajectory is idle, not an error: the run
    finishes, `first` trains every step, and `rollout/idle_trajectories` counts the idle ones."""
    env = {"id": "word-chain", "config": {"rounds": 1, "forfeit": True}}
    proc, out = rl(tmp_path, tiny_model_dir, env, steps=3)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((out / "logs").glob("*.log")))
    assert proc.returncode == 0, f"rl exited {proc.returncode}:\n{proc.stderr[-3000:]}\n{logs}"
    orch = read_jsonl(out / "metrics" / "orchestrator.jsonl")
    assert [m["step"] for m in orch] == [0, 1, 2]
    for m in orch:
        assert m["ledger/dispatched"] == sum(m[f"ledger/{b}"] for b in BUCKETS)
        assert m["rollout/trained_groups"] == 2 and "reward/seat/first/mean" in m
    last = orch[-1]
    idle = sum(m["rollout/idle_trajectories"] for m in orch)
    assert idle > 0 and last["env/episodes/idle"] >= idle
    assert last["ledger/errored"] == 0 and "env/errors/empty_completion" not in last
    # every trained group: group_size trajectories of `first`, plus `second`'s that acted
    assert 3 * 2 * 2 <= last["ledger/trained"] < 3 * 2 * 2 * 2
    trainer = read_jsonl(out / "metrics" / "trainer.jsonl")
    assert [m["step"] for m in trainer] == [0, 1, 2]
    assert all(m["loss/num_loss_tokens"] > 0 for m in trainer)
    # the episode log and the length bias take idle trajectories in their stride
    idle_lines = [e for e in read_jsonl(out / "metrics" / "episodes.jsonl") if e["status"] == "idle"]
    assert len(idle_lines) >= idle and all(e["tokens"] == e["completion_tokens"] == 0 for e in idle_lines)
    assert "rollout/length_bias" in last
