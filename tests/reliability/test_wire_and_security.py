"""Bad wire input and security defaults, over real ZeroMQ sockets (fast; no model).

Complements tests/transport (frame-level decode errors) and tests/inference/test_units.py (API key on the
admin routes, non-loopback host without key refused): here the faults arrive over a real socket, a
pickle payload must never be executed, and the configs' bind defaults and the resolved rl config are
checked.
"""

from __future__ import annotations

import logging
import pickle
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import zmq

from prime_async.config.env import EnvConfig
from prime_async.config.inference import InferenceConfig
from prime_async.config.rl import RLConfig
from prime_async.config.shared import TransportConfig
from prime_async.testing.synthetic import make_batch, transport_cfg
from prime_async.transport.wire import Request, WireError, encode_message
from prime_async.transport.zmq_batches import BatchReceiver, BatchSender

SRC = Path(__file__).resolve().parents[2] / "src" / "prime_async"
LAYOUT = [[[5, 7], [9]]]


class _Marker:
    """Unpickling this creates `path` (what a malicious payload would do)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def _pickle_payload(marker: Path) -> bytes:
    return pickle.dumps(_Marker(marker))


def test_pickle_payload_to_sender_is_rejected_and_never_loaded(tmp_path: Path, caplog) -> None:
    marker = tmp_path / "pwned"
    cfg = transport_cfg()
    caplog.set_level(logging.ERROR, logger="prime_async.transport.zmq_batches")
    with BatchSender(cfg=cfg, num_ranks=1) as sender:
        evil = zmq.Context.instance().socket(zmq.DEALER)
        evil.setsockopt(zmq.LINGER, 0)
        evil.connect(f"tcp://{cfg.host}:{cfg.port}")
        for payload in (_pickle_payload(marker), b"\x00garbage", b"", b"x" * 100_000):
            evil.send(payload)
            assert evil.poll(5000), "a bad request must be answered with an error, not silence"
            reply = evil.recv_multipart()
            assert len(reply) == 1 and b"error" in reply[0].lower()
        evil.send_multipart([b"a", b"b"])  # wrong frame count
        assert evil.poll(5000)
        evil.recv_multipart()
        evil.close()
        # the stream still serves a good trainer afterwards
        receiver = BatchReceiver(cfg=cfg, rank=0, world_size=1)
        thread = threading.Thread(target=lambda: sender.send(make_batch(0, LAYOUT)))
        thread.start()
        assert receiver.receive(0).step == 0
        thread.join(10)
        receiver.close()
    assert not marker.exists()
    assert any("bad request on the batch stream" in r.getMessage() for r in caplog.records)


def _fake_orchestrator(cfg: TransportConfig, reply: list[bytes]) -> threading.Thread:
    """A ROUTER that answers the first request with `reply` frames."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://{cfg.host}:{cfg.port}")

    def serve() -> None:
        if router.poll(10_000):
            identity = router.recv_multipart()[0]
            router.send_multipart([identity, *reply])
        router.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("kind", ["pickle", "unknown_type", "oversized", "wrong_step"])
def test_receiver_rejects_bad_batches_and_never_unpickles(kind: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    cfg = transport_cfg(max_frame_bytes=1024, timeout_s=10.0)
    good = _encoded_batch(step=3)
    reply = {
        "pickle": [_pickle_payload(marker)],
        "unknown_type": [b'{"type":"shutdown_now","step":0}'],
        "oversized": [good[0], b"\x00" * 4096, *good[2:]],
        "wrong_step": good,
    }[kind]
    thread = _fake_orchestrator(cfg, reply)
    receiver = BatchReceiver(cfg=cfg, rank=0, world_size=1)
    with pytest.raises(WireError) as info:
        receiver.receive(0)
    receiver.close()
    thread.join(10)
    message = str(info.value)
    assert message and "\n" not in message  # one clear line
    if kind == "wrong_step":
        assert re.search(r"asked for step 0 .* got step 3", message)
    assert not marker.exists()


def _encoded_batch(step: int) -> list[bytes]:
    """The frames a real sender puts on the wire for rank 0 of `make_batch(step)`."""
    cfg = transport_cfg()
    frames: list[bytes] = []
    with BatchSender(cfg=cfg, num_ranks=1) as sender:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{cfg.host}:{cfg.port}")
        thread = threading.Thread(target=lambda: sender.send(make_batch(step, LAYOUT)))
        thread.start()
        sock.send(encode_message(Request(step=step, rank=0, world_size=1)))
        assert sock.poll(10_000)
        frames = [bytes(f) for f in sock.recv_multipart()]
        thread.join(10)
        sock.close()
    return frames


def test_no_pickle_in_socket_facing_code() -> None:
    """No module of transport/inference/orchestrator imports pickle or loads tensors without weights_only."""
    offenders = []
    for area in ("transport", "inference", "orchestrator"):
        for path in (SRC / area).rglob("*.py"):
            text = path.read_text()
            if re.search(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle)\b", text, re.M):
                offenders.append(f"{path}: imports pickle")
            if re.search(r"\bpickle\.loads?\(|recv_pyobj|send_pyobj", text):
                offenders.append(f"{path}: pickle call")
            for call in re.findall(r"torch\.load\([^)]*\)", text):
                if "weights_only=True" not in call:
                    offenders.append(f"{path}: {call}")
    assert offenders == []


def test_every_server_binds_loopback_by_default() -> None:
    assert InferenceConfig().server.host == "127.0.0.1"
    assert TransportConfig().host == "127.0.0.1"
    assert EnvConfig.model_fields["gateway_host"].default == "127.0.0.1"
    rl = RLConfig()
    assert rl.inference.server.host == "127.0.0.1" and rl.transport.host == "127.0.0.1"
    assert rl.orchestrator.inference.base_urls == [f"http://127.0.0.1:{rl.inference.server.port}"]


def test_bound_address_of_a_running_sender_is_loopback() -> None:
    cfg = transport_cfg()
    with BatchSender(cfg=cfg, num_ranks=1):
        assert _listening_hosts(cfg.port) == {"127.0.0.1"}
    # reachable over loopback only: a connect to another local address of this host is refused
    other = _non_loopback_address()
    if other is not None:
        cfg = transport_cfg()  # a fresh port: ZMQ releases the first one asynchronously after close
        with BatchSender(cfg=cfg, num_ranks=1), pytest.raises(OSError):
            socket.create_connection((other, cfg.port), timeout=2).close()


def _listening_hosts(port: int) -> set[str]:
    """Addresses LISTENing on `port` (IPv4), from /proc/net/tcp."""
    hosts = set()
    deadline = time.monotonic() + 5
    while not hosts and time.monotonic() < deadline:
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:
                hosts.add(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return hosts


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent (UDP connect only picks a route)
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_rl_config_requires_api_key_off_loopback_and_propagates_it() -> None:
    with pytest.raises(ValueError, match="api_key"):
        RLConfig.model_validate({"inference": {"server": {"host": "0.0.0.0"}}})
    cfg = RLConfig.model_validate({"inference": {"server": {"host": "0.0.0.0", "api_key": "s3cret"}}})
    assert cfg.orchestrator.inference.api_key == "s3cret"
    assert cfg.orchestrator.inference.base_urls[0].startswith("http://127.0.0.1:")


def test_bound_address_of_a_running_gateway_is_loopback() -> None:
    import asyncio

    from prime_async.rollouts.gateway import Gateway

    async def main() -> set[str]:
        gateway = Gateway(engines=[object()], seq_len=64)  # type: ignore[list-item]  (no call reaches it)
        await gateway.start()
        try:
            return await asyncio.to_thread(_listening_hosts, gateway.port)
        finally:
            await gateway.stop()

    assert asyncio.run(main()) == {"127.0.0.1"}


def test_every_admin_route_refuses_a_missing_or_wrong_api_key(tiny_model_dir: Path) -> None:
    import torch
    from fastapi.testclient import TestClient

    from prime_async.inference.engine import Engine
    from prime_async.inference.engine_settings import EngineSettings, SlotSettings
    from prime_async.inference.server import build_app

    torch.set_num_threads(1)
    engine = Engine(
        EngineSettings(model_path=str(tiny_model_dir), slots=SlotSettings(max_running_requests=2, max_len=64))
    )
    routes = [
        ("post", "/pause_generation", {"mode": "abort"}),
        ("post", "/continue_generation", {}),
        ("post", "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": "9"}),
        ("post", "/abort_request", {"abort_all": True}),
        ("post", "/flush_cache", {}),
        ("get", "/flush_cache", None),
        ("get", "/get_server_info", None),
    ]
    with TestClient(build_app(engine, api_key="s3cret")) as client:
        assert client.get("/health").status_code == 200  # liveness stays open (the launcher polls it)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for method, route, body in routes:
                kw = {"json": body} if body is not None else {}
                r = getattr(client, method)(route, headers=headers, **kw)
                assert r.status_code == 401, (route, headers, r.status_code)
        ok = client.get("/get_server_info", headers={"Authorization": "Bearer s3cret"})
        assert (
            ok.status_code == 200 and str(ok.json()["weight_version"]) == "0"
        )  # the refused update did nothing
