"""A real tiny `rl` run with CURVE on while a foreign client hammers the batch stream and the control channel.

`rl` (ports 0, `transport.curve = "on"` on 127.0.0.1: the path a non-loopback host takes) generates the
keys into output_dir/transport_keys; a foreign client without keys, with a key pair of its own, or with
another server key asks for batches, sends `Hello`, `Published` and garbage the whole run long. It gets
nothing back, the run completes, every batch is trained by the real trainer (the orchestrator's and the
trainer's steps match, the trainer's identity never changes) and the refusals are in the orchestrator's log.
"""

from __future__ import annotations

import itertools
import os
import stat
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest
import zmq
import zmq.auth
from test_curve import _foreign_socket

import zygote
from prime_async.transport.wire import Request, encode_message
from prime_async.weights.control import Hello, Published, encode
from proc_helpers import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("none", "own", "wrong-server")


class ForeignClient:
    """Connects to both sockets of the run (once `rl` wrote the orchestrator's config) and sends every
    kind of frame, from fresh sockets of each key kind, until stopped; counts what it sent and received."""

    def __init__(self, out: Path):
        self.out, self.sent, self.received = out, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _wait_for_run(self) -> tuple[int, bytes] | None:
        cfg_path, key_path = (
            self.out / "configs" / "orchestrator.toml",
            self.out / "transport_keys" / "server.key",
        )
        while not self._stop.is_set():
            if cfg_path.is_file() and key_path.is_file():
                port = tomllib.loads(cfg_path.read_text())["transport"]["port"]
                return port, zmq.auth.load_certificate(key_path)[0]
            time.sleep(0.2)
        return None

    def _run(self) -> None:
        found = self._wait_for_run()
        if found is None:
            return
        port, server_public = found
        frames = [
            encode_message(Request(step=0, rank=0, world_size=1)), encode(Hello("impostor")),
            encode(Published(10**6, "filesystem")), b"\x93garbage",
        ]  # fmt: skip
        for step, keys in zip(itertools.count(), itertools.cycle(KEYS)):
            if self._stop.is_set():
                return
            frames[0] = encode_message(Request(step=step % 8, rank=0, world_size=1))
            for target in (port, port + 1):
                self._hammer(f"tcp://127.0.0.1:{target}", keys, server_public, frames)

    def _hammer(self, address: str, keys: str, server_public: bytes, frames: list[bytes]) -> None:
        sock = _foreign_socket(address, keys, server_public)
        for frame in frames:
            try:
                sock.send(frame)
            except zmq.Again:  # not even queued (no connection up: a refused handshake), nothing delivered
                continue
            self.sent += 1
        if sock.poll(300):
            self.received.append(sock.recv_multipart())
        sock.close(linger=0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rl_run_with_curve_trains_every_batch_while_a_foreign_client_hammers(
    tiny_model_dir, tmp_path
) -> None:
    out, steps = tmp_path / "run", 4
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(ROOT / "configs/tiny/rl.toml"),
        "--output-dir", str(out), "--model.path", str(tiny_model_dir), "--max-steps", str(steps),
        "--inference.server.port", "0", "--transport.port", "0", "--transport.curve", "on",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline"}
    foreign = ForeignClient(out)
    try:
        proc = zygote.run(cmd, cwd=ROOT, env=env, timeout=840)
    finally:
        foreign.stop()
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((out / "logs").glob("*.log")))
    assert proc.returncode == 0, f"rl exited {proc.returncode}:\n{proc.stderr[-3000:]}\n{logs}"

    assert foreign.sent > 0 and foreign.received == []
    orch = read_jsonl(out / "metrics" / "orchestrator.jsonl")
    trainer = read_jsonl(out / "metrics" / "trainer.jsonl")
    assert [m["step"] for m in orch] == [m["step"] for m in trainer] == list(range(steps))
    assert sum(m["weights/updates"] for m in orch) >= 1  # the control channel kept its real trainer
    text = (out / "logs" / "orchestrator.log").read_text()
    connected = [line for line in text.splitlines() if "control channel: trainer" in line]
    assert connected and all("impostor" not in line for line in connected), connected
    for label in ("batch stream", "control channel"):
        assert f"{label}: refused a peer at 127.0.0.1 (its CURVE key" in text
        assert f"{label}: refused a peer at an address on tcp://127.0.0.1" in text
        assert "(CURVE handshake failed: no CURVE keys)" in text
    keys = out / "transport_keys"
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in keys.iterdir()} == {0o600}
    orch_cfg = tomllib.loads((out / "configs" / "orchestrator.toml").read_text())
    assert orch_cfg["transport"]["curve_keys_dir"] == str(keys)
