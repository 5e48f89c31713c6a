"""CURVE on the batch stream and the control channel, over real ZeroMQ sockets (fast; no model).

The binds are 127.0.0.1 with `transport.curve = "on"` (the path a non-loopback host takes). A foreign
client with no keys or the wrong keys connects to both sockets, asks for batches, sends `Hello` and
garbage: it gets nothing, changes nothing (the real trainer's identity stays), and the refusals are
logged naming the peer. Bad frames from a peer that did get through (loopback, or an authenticated one)
are logged and dropped; the serving loops go on. Also: key generation (0700 directory, 0600 files), the
one-line refusals, and loopback without keys working as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.auth

from prime_async.config.shared import TransportConfig
from prime_async.testing.synthetic import make_batch, transport_cfg
from prime_async.transport import zap
from prime_async.transport.curve import check_keys, curve_on, generate_keys, is_loopback, secure_client
from prime_async.transport.wire import Request, encode_message
from prime_async.transport.zmq_batches import BatchReceiver, BatchSender, RankBatch
from prime_async.weights.control import ControlClient, ControlServer, Hello, Published, encode

LAYOUT = [[[5, 7], [9]]]


def _curve_cfg(keys: Path) -> TransportConfig:
    return transport_cfg(curve="on", curve_keys_dir=keys)


SEND_TIMEOUT_MS = 1000


def _foreign_socket(address: str, keys: str, server_public: bytes) -> zmq.Socket:
    """A DEALER with no keys ("none"), a key pair of its own and the run's server key ("own"), or a key
    pair of its own and another server key ("wrong-server")."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # a send blocks while no connection is up (a refused handshake drops it until the next reconnect)
    sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    if keys != "none":
        public, secret = zmq.curve_keypair()
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.setsockopt(zmq.CURVE_SERVERKEY, public if keys == "wrong-server" else server_public)
    sock.connect(address)
    return sock


def _hammer(address: str, frames: list[bytes], keys: str, server_public: bytes) -> list[list[bytes]]:
    """Send `frames` from a foreign socket; return whatever came back within a second."""
    sock = _foreign_socket(address, keys, server_public)
    try:
        for frame in frames:
            with contextlib.suppress(zmq.Again):  # tolerated: not even queued, so nothing was delivered
                sock.send(frame)
        got = []
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            if sock.poll(100):
                got.append(sock.recv_multipart())
        return got
    finally:
        sock.close(linger=0)


def _receive_while_sending(sender: BatchSender, rx: BatchReceiver) -> RankBatch:
    """Batch 0 as the trainer rank gets it (the sender waits for its READY in a thread)."""
    sent = threading.Thread(target=lambda: sender.send(make_batch(0, LAYOUT)))
    sent.start()
    got = rx.receive(0)
    sent.join(10)
    return got


def _server_public(keys: Path) -> bytes:
    public, _ = zmq.auth.load_certificate(keys / "server.key")
    return public


def test_loopback_rule_and_refusals(tmp_path: Path) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5") and not is_loopback("orch-node")
    assert not curve_on(TransportConfig()) and curve_on(TransportConfig(host="0.0.0.0"))
    check_keys(TransportConfig(), side="server")  # loopback, no keys: as before
    with pytest.raises(ValueError) as exc:
        check_keys(TransportConfig(host="0.0.0.0"), side="server")
    assert str(exc.value) == (
        "transport.host = '0.0.0.0' is not loopback: set transport.curve_keys_dir (or bind 127.0.0.1)"
    )
    with pytest.raises(ValueError, match="is missing"):
        check_keys(TransportConfig(host="0.0.0.0", curve_keys_dir=tmp_path), side="client")
    keys = generate_keys(tmp_path / "keys")
    check_keys(TransportConfig(host="0.0.0.0", curve_keys_dir=keys), side="server")
    (keys / "client.key_secret").chmod(0o644)
    with pytest.raises(ValueError, match="readable by other users"):
        check_keys(TransportConfig(host="0.0.0.0", curve_keys_dir=keys), side="client")


def test_generated_keys_are_owner_only_and_kept(tmp_path: Path) -> None:
    keys = generate_keys(tmp_path / "run" / "transport_keys")
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    names = sorted(p.name for p in keys.iterdir())
    assert names == ["client.key", "client.key_secret", "server.key", "server.key_secret"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in keys.iterdir())
    before = (keys / "server.key_secret").read_bytes()
    assert generate_keys(keys) == keys and (keys / "server.key_secret").read_bytes() == before


def test_batch_stream_with_curve_serves_the_trainer_and_nothing_to_foreign_peers(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="prime_async.transport.zap")
    cfg = _curve_cfg(generate_keys(tmp_path / "keys"))
    address = f"tcp://{cfg.host}:{cfg.port}"
    server_public = _server_public(cfg.curve_keys_dir)
    ask = encode_message(Request(step=0, rank=0, world_size=1))
    with BatchSender(cfg=cfg, num_ranks=1) as sender:
        for keys in ("none", "own", "wrong-server"):
            assert _hammer(address, [ask, b"\x00garbage"], keys, server_public) == []
        assert sender.delivered_step() is None and not sender._all_ready.is_set()
        rx = BatchReceiver(cfg=cfg, rank=0, world_size=1)
        assert _receive_while_sending(sender, rx).step == 0
        for keys in ("none", "own"):
            assert (
                _hammer(address, [ask], keys, server_public) == []
            )  # step 0 is cached: still nothing for them
        rx.close()
    refused = [r.getMessage() for r in caplog.records if "refused a peer" in r.getMessage()]
    assert any("batch stream: refused a peer at 127.0.0.1 (its CURVE key" in m for m in refused), refused
    for why in ("no CURVE keys", "not this run's server key"):
        assert any(f"CURVE handshake failed: {why}" in m for m in refused), refused


def test_control_channel_with_curve_keeps_the_real_trainer(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="prime_async.transport.zap")
    cfg = _curve_cfg(generate_keys(tmp_path / "keys"))
    address = f"tcp://{cfg.host}:{cfg.port + 1}"
    server_public = _server_public(cfg.curve_keys_dir)
    published: list[Published] = []

    async def go() -> tuple[str, list[int]]:
        server = ControlServer(cfg.host, cfg.port + 1, on_published=published.append, transport=cfg)
        server.start()
        client = ControlClient(cfg.host, cfg.port + 1, handler=lambda msg, reply: None, transport=cfg)
        try:
            await server.wait_trainer(10)
            trainer = server._trainer
            frames = [encode(Hello("impostor")), encode(Published(99, "filesystem")), b"\x93garbage"]
            for keys in ("none", "own", "wrong-server"):
                assert await asyncio.to_thread(_hammer, address, frames, keys, server_public) == []
            client.publish(Published(1, "filesystem"))
            for _ in range(100):
                if published:
                    break
                await asyncio.sleep(0.05)
            return server._trainer == trainer, [p.version for p in published]
        finally:
            client.close()
            await server.close()

    same_trainer, versions = asyncio.run(go())
    assert same_trainer and versions == [1]
    assert any("control channel: refused a peer at 127.0.0.1" in r.getMessage() for r in caplog.records)
    assert not zap._handlers  # the last server closed: the ZAP handler stopped


def test_bad_control_frames_from_a_loopback_peer_are_dropped_and_the_loop_goes_on(caplog) -> None:
    cfg = transport_cfg()
    caplog.set_level(logging.ERROR, logger="prime_async.weights.control")
    published: list[Published] = []
    errors: list[BaseException] = []

    async def go() -> None:
        server = ControlServer(
            cfg.host, cfg.port + 1, on_published=published.append, on_error=errors.append, transport=cfg
        )
        server.start()
        try:
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{cfg.host}:{cfg.port + 1}")
            bad = [
                [b"\x93garbage"],
                [b"a", b"b"],
                [msgspec.msgpack.encode({"type": "published", "version": "x"})],
                [encode(Hello("old", protocol=0))],
                [encode(Published(1, "filesystem")).replace(b"p", b"q", 1)],
            ]
            for frames in bad:
                sock.send_multipart(frames)
            sock.send(encode(Published(7, "filesystem")))
            for _ in range(100):
                if published:
                    break
                await asyncio.sleep(0.05)
            sock.close(linger=0)
        finally:
            await server.close()

    asyncio.run(go())
    assert [p.version for p in published] == [7] and errors == []
    dropped = [r.getMessage() for r in caplog.records if "frame dropped" in r.getMessage()]
    assert len(dropped) >= 4, dropped


def test_loopback_without_keys_works_as_before() -> None:
    cfg = transport_cfg()
    assert cfg.curve_keys_dir is None
    with BatchSender(cfg=cfg, num_ranks=1) as sender:
        rx = BatchReceiver(cfg=cfg, rank=0, world_size=1)
        assert _receive_while_sending(sender, rx).step == 0
        rx.close()
    assert not zap._handlers


def test_trainer_side_refuses_before_connecting_without_keys() -> None:
    cfg = TransportConfig(host="10.255.255.1", port=5557)
    with pytest.raises(ValueError, match=r"is not loopback: set transport\.curve_keys_dir"):
        ControlClient(cfg.host, 5558, handler=lambda msg, reply: None, transport=cfg)
    with pytest.raises(ValueError, match="is not loopback"):
        BatchReceiver(cfg=cfg, rank=0, world_size=1)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    with pytest.raises(ValueError, match="is not loopback"):
        secure_client(sock, cfg)
    sock.close(linger=0)


@pytest.mark.parametrize(("command", "host"), [("orchestrator", "0.0.0.0"), ("trainer", "10.1.2.3")])
def test_non_loopback_bind_without_keys_is_refused_in_one_line(command: str, host: str, tmp_path) -> None:
    repo = Path(__file__).resolve().parents[2]
    argv = [
        sys.executable,
        "-m",
        f"prime_async.entrypoints.{command}",
        "@",
        f"configs/multinode/{command}.toml",
    ]
    argv += ["--transport.host", host, "--output-dir", str(tmp_path), "--dry-run"]
    done = subprocess.run(argv, cwd=repo, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    want = (
        f"{command}: error: transport.host = '{host}' is not loopback: set transport.curve_keys_dir (or bind "
    )
    assert done.stderr.strip().splitlines() == [want + "127.0.0.1)"]


def test_rl_generates_the_keys_and_hands_them_to_every_component(tmp_path: Path) -> None:
    from prime_async.config.rl import RLConfig
    from prime_async.launcher.rl import with_transport_keys

    plain = RLConfig.model_validate({"output_dir": str(tmp_path / "a")})
    assert with_transport_keys(plain) is plain and not (tmp_path / "a" / "transport_keys").exists()
    cfg = with_transport_keys(
        RLConfig.model_validate({"output_dir": str(tmp_path), "transport": {"curve": "on"}})
    )
    keys = tmp_path / "transport_keys"
    assert cfg.transport.curve_keys_dir == cfg.orchestrator.transport.curve_keys_dir == keys
    assert cfg.trainer.transport.curve_keys_dir == keys and cfg.transport.curve == "on"
    check_keys(cfg.orchestrator.transport, side="server")
    check_keys(cfg.trainer.transport, side="client")
