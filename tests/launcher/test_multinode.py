"""The multi-node recipe on localhost: every component started by its own command, not by `rl`.

As docs/multi-node.md lays it out, from the files in configs/multinode/: two embedded engines (two
`inference` commands), a 2-rank trainer as two torchrun "nodes" (`--nnodes 2 --node-rank 0|1`, static
rendezvous, FSDP2 with gloo), and the orchestrator. Weights travel over torch.distributed (gloo): trainer
rank 0 + both engines form one weight process group. The run trains 3 steps; both engines must have received
the versions over the group, and every process must exit on its own (engines are stopped by the test).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from proc_helpers import free_pair, free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs" / "multinode"


def start(name: str, cmd: list[str], logs: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline"}
    log = (logs / f"{name}.out").open("w")
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.mark.timeout(1200)
@pytest.mark.needs_devices(2)  # two trainer nodes on this machine, one rank each
def test_multinode_recipe_on_localhost(tiny_model_dir: Path, tmp_path: Path) -> None:
    out, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    shared = ["--output-dir", str(out), "--model.path", str(tiny_model_dir)]
    engine_ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in engine_ports]
    batches, torch_master, weight_master = free_pair(), free_port(), free_port()
    procs: list[subprocess.Popen] = []
    module = [sys.executable, "-m"]
    try:
        for i, port in enumerate(engine_ports):
            cmd = [
                *module,
                "prime_async.entrypoints.inference",
                "@",
                str(CONFIGS / "inference.toml"),
                *shared,
            ]
            procs.append(start(f"inference{i}", [*cmd, "--server.port", str(port)], logs))
        for url, proc in zip(urls, procs, strict=True):
            wait_healthy(url, proc, timeout_s=600)
        trainers = []
        for node in (0, 1):
            rendezvous = ["--master-addr", "127.0.0.1", "--master-port", str(torch_master)]
            torchrun = [
                *module,
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                *rendezvous,
            ]
            torchrun += ["--nproc-per-node", "1"]
            entry = ["-m", "prime_async.entrypoints.trainer", "@", str(CONFIGS / "trainer.toml"), *shared]
            trainers.append(
                start(f"trainer_node{node}", [*torchrun, *entry, "--transport.port", str(batches)], logs)
            )
        cmd = [
            *module,
            "prime_async.entrypoints.orchestrator",
            "@",
            str(CONFIGS / "orchestrator.toml"),
            *shared,
        ]
        ports = ["--transport.port", str(batches), "--weights.master-port", str(weight_master)]
        orchestrator = start("orchestrator", [*cmd, *ports, "--inference.base-urls", json.dumps(urls)], logs)
        procs += [*trainers, orchestrator]
        for proc in [orchestrator, *trainers]:
            assert proc.wait(timeout=1000) == 0, _tails(logs)
    finally:
        for proc in procs:
            stop(proc)

    orch = [json.loads(line) for line in (out / "metrics" / "orchestrator.jsonl").read_text().splitlines()]
    assert [m["step"] for m in orch] == [0, 1, 2]
    # Async with K = 1: the batch of step n may come from version n - 1, so when the engines loaded
    # which version is timing; what is guaranteed is the staleness bound and that updates happened.
    served = [m["weights/served_version"] for m in orch]
    assert all(v >= m["step"] - 1 for v, m in zip(served, orch, strict=True)), served
    assert served[-1] >= 1, served
    trainer = [json.loads(line) for line in (out / "metrics" / "trainer.jsonl").read_text().splitlines()]
    assert [m["step"] for m in trainer] == [0, 1, 2]
    for i in (0, 1):
        engine_log = (logs / f"inference{i}.out").read_text()
        assert f"as rank {i + 1} of 3 (gloo)" in engine_log
        assert "tensors from group prime-async-weights-" in engine_log
    assert (out / "broadcasts" / "step_2" / "STABLE").is_file()  # ckpt.interval = 2: on disk too
    assert (out / "broadcasts" / "step_3" / "STABLE").is_file()  # the last step


def _tails(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(logs.glob("*.out")))
