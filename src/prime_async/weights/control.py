"""Control channel trainer <-> orchestrator: weight-version events and the distributed-weights handshake.

ZeroMQ ROUTER (orchestrator, binds `transport.host:weights.control_port`, default `transport.port + 1`)
<-> DEALER (trainer rank 0, connects); one msgspec frame per message, never pickle.

    trainer rank 0                                      orchestrator (ControlServer)
      Hello (at start, then every HELLO_INTERVAL_S) ──►  learns the trainer's identity (restarts too)
      Published(version, buckets)                   ──►  WeightWatcher wakes at once (event-driven)
                                            ◄── JoinGroup(request_id, ...)   distributed: build the group
      Reply(request_id, ok)  (after joining)        ──►
                                            ◄── SendWeights(request_id, version)
      Reply(request_id, ok, phase="ack")            ──►  the trainer holds that version: engines are told
      ... broadcasts every bucket ...                     to receive (`/update_weights_from_distributed`)
      Reply(request_id, ok, phase="done")           ──►
                                            ◄── Lend(request_id, version, copies)   shared: the trainer
      Reply(request_id, ok, shares=[SharedVersion])  ──►  keeps that version; engines map and copy it
                                            ◄── GiveBack(request_id, version)   (after every engine
      Reply(request_id, ok)                          ──►   answered): it may be dropped again

Invariants: every request gets exactly one "done" reply (SendWeights also one "ack" first); a malformed
frame raises `WireError` on the trainer's side, and is logged and dropped on the orchestrator's (a foreign
peer never ends the run; off loopback only CURVE peers with the run's client key get through, curve.py);
events are hints: a lost `Published` only delays an update until the watcher's fallback poll (the
broadcast directory, or the next event).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Literal

import msgspec
import zmq
import zmq.asyncio

from prime_async.config.shared import TransportConfig
from prime_async.transport.curve import check_keys, secure_client, secure_server
from prime_async.transport.wire import WireError
from prime_async.types import WeightTransport
from prime_async.weights.probe import ProbeReference
from prime_async.weights.shared_wire import SharedVersion
from prime_async.weights.tensor_meta import TensorMeta

logger = logging.getLogger(__name__)

CONTROL_PROTOCOL = 1
VERSION_GONE = "versions held"  # a SendWeights refusal's words when the version is no longer in memory
HELLO_INTERVAL_S = 2.0


class Hello(msgspec.Struct, tag="hello", frozen=True):
    trainer_id: str
    device: str = "cpu"  # device type of trainer rank 0: resolves weights.backend = "auto"
    protocol: int = CONTROL_PROTOCOL


class Published(msgspec.Struct, tag="published", frozen=True):
    """Trainer: weights `version` exist (filesystem: its STABLE directory; distributed: held in memory,
    sent in `buckets` order; shared: held in shared memory, lent on `Lend`)."""

    version: int
    transport: WeightTransport
    buckets: list[list[TensorMeta]] = []
    probe: ProbeReference | None = None  # the trainer's logprobs of the weight probe (`weights/probe.py`)


class JoinGroup(msgspec.Struct, tag="join_group", frozen=True):
    request_id: int
    master_address: str
    master_port: int
    world_size: int
    group_name: str
    backend: str


class SendWeights(msgspec.Struct, tag="send_weights", frozen=True):
    request_id: int
    version: int
    group_name: str


class Lend(msgspec.Struct, tag="lend", frozen=True):
    """shared: describe `version` for `copies` engines and keep it until `GiveBack` (or the next Lend)."""

    request_id: int
    version: int
    copies: int


class GiveBack(msgspec.Struct, tag="give_back", frozen=True):
    request_id: int
    version: int


class Reply(msgspec.Struct, tag="reply", frozen=True):
    request_id: int
    ok: bool
    phase: Literal["ack", "done"] = "done"
    message: str = ""
    shares: list[SharedVersion] = []  # a Lend's answer: one description per engine


ControlRequest = JoinGroup | SendWeights | Lend | GiveBack
Message = Hello | Published | JoinGroup | SendWeights | Lend | GiveBack | Reply
_decoder = msgspec.msgpack.Decoder(Message)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(frame: bytes) -> Message:
    try:
        return _decoder.decode(frame)
    except msgspec.DecodeError as e:
        raise WireError(f"control channel: malformed message ({e})") from e


def _send_or_drop(sock: zmq.Socket, frame: bytes) -> None:
    """Events are hints: with no orchestrator for a long time the queue fills, and they are dropped."""
    try:
        sock.send(frame, zmq.NOBLOCK)
    except zmq.Again:
        logger.debug("control channel: queue full, event dropped")


def _decode_or_drop(parts: list[bytes]) -> Message | None:
    """The message of one ROUTER delivery ([identity, frame]), or None (logged at ERROR, dropped) when it is
    malformed, speaks another protocol or is not for the orchestrator: a bad frame never ends the run."""
    peer = parts[0].decode(errors="replace") if parts else "?"
    try:
        if len(parts) != 2:
            raise WireError(f"control channel: expected 1 frame, got {len(parts) - 1}")
        msg = decode(parts[1])
        if isinstance(msg, Hello) and msg.protocol != CONTROL_PROTOCOL:
            raise WireError(f"control channel: trainer protocol {msg.protocol}, not {CONTROL_PROTOCOL}")
        if not isinstance(msg, Hello | Published | Reply):
            raise WireError(f"control channel: {type(msg).__name__} is not a trainer's message")
    except WireError as e:
        logger.error("%s (from peer %r): frame dropped", e, peer)
        return None
    return msg


class ControlServer:
    """Orchestrator side, on the asyncio loop: events to `on_published`, requests to the trainer."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        on_published: Callable[[Published], None],
        on_error: Callable[[BaseException], None] = lambda e: None,
        transport: TransportConfig | None = None,
    ):
        """`transport`: CURVE when it says so (transport/curve.py; None: plain TCP, tests)."""
        self.on_error = on_error
        self.address = f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"
        self.on_published = on_published
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        self._guard = secure_server(self._sock, transport, label="control channel") if transport else None
        self._sock.bind(self.address)
        self._trainer: bytes | None = None
        self.last_heard: float | None = None  # time.monotonic() of the trainer's last message (Hello: 2 s)
        self.trainer_device = "cpu"
        self._trainer_known = asyncio.Event()
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Queue[Reply]] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._recv_loop(), name="control-channel")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._sock.close(linger=0)
        if self._guard is not None:
            self._guard.close()

    async def _recv_loop(self) -> None:
        try:
            await self._serve()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # handed to the supervised side (the weight watcher), which fails the run
            logger.error("control channel failed: %s", e)
            self.on_error(e)

    async def _serve(self) -> None:
        while True:
            parts = await self._sock.recv_multipart()
            msg = _decode_or_drop(parts)  # a malformed or foreign frame is logged and dropped
            if msg is None:
                continue
            identity = parts[0]
            if self._trainer != identity:
                logger.info("control channel: trainer %s connected", identity.decode(errors="replace"))
            self._trainer = identity
            self.last_heard = time.monotonic()
            self._trainer_known.set()
            if isinstance(msg, Published):
                self.on_published(msg)
            elif isinstance(msg, Reply) and msg.request_id in self._replies:
                self._replies[msg.request_id].put_nowait(msg)
            elif isinstance(msg, Hello):
                self.trainer_device = msg.device

    async def wait_trainer(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._trainer_known.wait(), timeout_s)
        except TimeoutError:
            raise RuntimeError(f"no trainer said hello on {self.address} within {timeout_s:.0f} s") from None

    def open_request(self, make: Callable[[int], ControlRequest]) -> Request:
        """Send a request to the trainer; its replies arrive on the returned handle."""
        if self._trainer is None:
            raise RuntimeError("control channel: no trainer connected yet")
        request_id = next(self._ids)
        queue: asyncio.Queue[Reply] = asyncio.Queue()
        self._replies[request_id] = queue
        self._sock.send_multipart([self._trainer, encode(make(request_id))])
        return Request(request_id, queue, lambda: self._replies.pop(request_id, None))


class Refused(RuntimeError):
    """The trainer answered a request with a refusal (its message says why)."""


class Request:
    """Replies to one request; `close()` stops collecting them."""

    def __init__(self, request_id: int, queue: asyncio.Queue[Reply], close: Callable[[], object]):
        self.request_id, self._queue, self.close = request_id, queue, close

    async def reply(self, phase: str, timeout_s: float) -> Reply:
        """The next reply, which must be of `phase`; `Refused` on a refusal, RuntimeError on a timeout."""
        try:
            reply = await asyncio.wait_for(self._queue.get(), timeout_s)
        except TimeoutError:
            raise RuntimeError(
                f"trainer did not answer request {self.request_id} within {timeout_s:.0f} s"
            ) from None
        if not reply.ok:
            raise Refused(f"trainer refused request {self.request_id}: {reply.message}")
        if reply.phase != phase:
            raise WireError(f"control channel: expected a {phase!r} reply, got {reply.phase!r}")
        return reply


Handler = Callable[[ControlRequest, Callable[[Reply], None]], None]


class ControlClient:
    """Trainer rank 0: one background thread owns the DEALER; `publish` may be called from any thread.

    Requests are handed to `handler(msg, reply)` on that thread, one at a time (`reply` sends a Reply)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        handler: Handler,
        device: str = "cpu",
        transport: TransportConfig | None = None,
    ):
        """`transport`: CURVE when it says so (transport/curve.py; None: plain TCP, tests)."""
        if transport is not None:
            check_keys(transport, side="client")  # refused here, not later in the thread
        self.transport = transport
        self.device = device
        self.address = f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"
        self.trainer_id = f"trainer-{uuid.uuid4().hex[:8]}"
        self.handler = handler
        self._ctx = zmq.Context.instance()
        self._inbox = f"inproc://control-{self.trainer_id}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self._inbox)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.connect(self._inbox)
        self._push_lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="control-channel", daemon=True)
        self._thread.start()

    def publish(self, msg: Published) -> None:
        self._send(msg)

    def _send(self, msg: Message) -> None:
        if self._error is not None:
            raise RuntimeError(f"control channel failed: {self._error}") from self._error
        with self._push_lock:
            self._push.send(encode(msg))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        with self._push_lock:
            self._push.close(linger=0)

    def _run(self) -> None:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, self.trainer_id.encode())
        dealer.setsockopt(zmq.LINGER, 500)  # a last Published still leaves at shutdown
        if ":" in self.address.split("//")[1].split("]")[0]:
            dealer.setsockopt(zmq.IPV6, 1)
        if self.transport is not None:
            secure_client(dealer, self.transport)
        dealer.connect(self.address)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        last_hello = 0.0
        try:
            while not self._stop.is_set():
                if time.monotonic() - last_hello >= HELLO_INTERVAL_S:
                    _send_or_drop(dealer, encode(Hello(self.trainer_id, self.device)))
                    last_hello = time.monotonic()
                events = dict(poller.poll(timeout=200))
                if self._pull in events:
                    _send_or_drop(dealer, self._pull.recv())
                if dealer in events:
                    msg = decode(dealer.recv())
                    if isinstance(msg, JoinGroup | SendWeights | Lend | GiveBack):
                        self.handler(msg, lambda reply: dealer.send(encode(reply)))
            while self._pull.poll(0):  # flush what was published before close()
                _send_or_drop(dealer, self._pull.recv())
        except BaseException as e:  # reported by the next publish(); the trainer fails loudly
            logger.exception("control channel thread failed")
            self._error = e
        finally:
            dealer.close()
            self._pull.close(linger=0)
