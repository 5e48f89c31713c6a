"""ZeroMQ batch stream: `BatchSender` (orchestrator, ROUTER, binds) -> `BatchReceiver` (trainer rank, DEALER).

The stream is pull-based: a trainer rank asks for batch `step` with a `Request`, and the sender answers
with that rank's slice as soon as the batch exists. The first request of a rank is its READY handshake.

    orchestrator main loop            sender thread (owns the ROUTER)          trainer rank r
      send(batch n) ──cache[n]──►  serve pending/new requests  ◄── Request(step n) ── receive(n)
                                   ──► [BatchHeader][arrays...] ─────────────────────►

Invariants:
- no batch is lost to a slow joiner: `send` first waits until every rank said READY, and a batch stays
  cached until every rank has asked for a later step (plus `resend_window` newest ones, for restarts);
- a restarted trainer (`--resume`) reconnects with a fresh identity and asks for its next step; the sender
  serves it from the cache. A step that was evicted gets an `ErrorReply`, and the trainer fails loudly
  (`transport.resend_window` >= the trainer's `ckpt.interval` makes every restart servable);
- step `n` is answered with batch `n` only; a receiver that gets anything else raises `WireError`;
- after `stop_serving` (a planned stop) no step newer than the one it returned is answered: the stopped
  lifetime's checkpoint carries those batches, the resumed lifetime cuts and serves them;
- array frames are sent with `copy=False` from the cached arrays; nothing is pickled;
- off loopback (or `transport.curve = "on"`) both ends use CURVE (`curve.py`): a peer without the run's
  client key gets nothing; a malformed request from an admitted peer gets an `ErrorReply`, never a batch.
The sender's socket lives in one background thread (ZeroMQ sockets are not thread-safe); its failures are
re-raised by the next `send`/`wait_ready`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import zmq

from prime_async.config.shared import TransportConfig
from prime_async.transport.curve import ServerGuard, secure_client, secure_server
from prime_async.transport.types import MicroBatch, TrainBatch
from prime_async.transport.wire import (
    ErrorReply,
    Request,
    WireError,
    decode_message,
    decode_rank_slice,
    encode_message,
    encode_rank_slice,
)

logger = logging.getLogger(__name__)

BIND_RETRY_S = 2.0  # how long a bind waits for a port this process's previous sender is still releasing


@dataclass
class RankBatch:
    """One trainer rank's share of batch `step`, plus the batch-level fields."""

    step: int
    rank: int
    micro_batches: list[MicroBatch]
    layout: list[list[int]]  # tokens per micro-batch, per rank (whole batch)
    num_loss_tokens: int  # whole batch (all ranks)
    temperature: float
    min_dispatch_version: int
    metrics: dict[str, float] = field(default_factory=dict)
    max_dispatch_version: int = -1  # -1 = not reported
    teacher_kl_weight: float = 0.0  # on-policy distillation: rows carry teacher_logprobs when > 0

    @classmethod
    def of(cls, batch: TrainBatch, rank: int) -> RankBatch:
        """Rank `rank`'s share of a whole batch built in this process (no wire: `sft` feeds its trainer
        this way); the same fields the receiver decodes from the sender's frames."""
        return cls(
            step=batch.step, rank=rank, micro_batches=batch.micro_batches[rank],
            layout=[[mb.num_tokens for mb in mbs] for mbs in batch.micro_batches],
            num_loss_tokens=batch.num_loss_tokens, temperature=batch.temperature,
            min_dispatch_version=batch.min_dispatch_version, metrics=dict(batch.metrics),
            max_dispatch_version=batch.max_dispatch_version,
            teacher_kl_weight=batch.teacher_kl_weight,
        )  # fmt: skip

    @property
    def max_micro_batches(self) -> int:
        """Micro-batches of the busiest rank: every rank runs this many forward/backward passes."""
        return max(len(r) for r in self.layout)


class BatchSender:
    """Orchestrator side: binds a ROUTER, caches encoded batches, answers each rank's requests."""

    def __init__(self, *, cfg: TransportConfig, num_ranks: int, resend_window: int | None = None):
        resend_window = cfg.resend_window if resend_window is None else resend_window
        if num_ranks < 1 or resend_window < 1:
            raise ValueError("num_ranks and resend_window must be >= 1")
        self.cfg, self.num_ranks, self.resend_window = cfg, num_ranks, resend_window
        self._ctx = zmq.Context.instance()
        self._lock = threading.Lock()
        self._cache: OrderedDict[int, list[list]] = OrderedDict()  # step -> per-rank frames
        self._pending: dict[bytes, Request] = {}  # requester identity -> request not yet servable
        self._next_needed: dict[int, int] = {}  # rank -> newest step it asked for
        self._delivered: dict[int, int] = {}  # rank -> newest step whose slice was handed to ZeroMQ
        self._frozen_at: int | None = None  # set by `stop_serving`: no step newer than this is answered
        self._all_ready = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._last_step: int | None = None
        self._wake_addr = f"inproc://batch-sender-{uuid.uuid4().hex}"
        self._wake_pull = self._ctx.socket(zmq.PULL)
        self._wake_pull.bind(self._wake_addr)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable peer -> error, not a silent drop
        self._router.setsockopt(zmq.LINGER, 0)
        self._guard: ServerGuard | None = None
        try:
            self._guard = secure_server(self._router, cfg, label="batch stream")  # CURVE off loopback
        except ValueError:
            self._close_sockets()
            raise
        self._bind_router(cfg)
        self._wake_push = self._ctx.socket(zmq.PUSH)
        self._wake_push.connect(self._wake_addr)
        self._thread = threading.Thread(target=self._serve, name="batch-sender", daemon=True)
        self._thread.start()
        logger.info("batch sender bound to tcp://%s:%d for %d rank(s)", cfg.host, cfg.port, num_ranks)

    def _bind_router(self, cfg: TransportConfig) -> None:
        """Bind the ROUTER; a taken or unset port is a user error named in one line (ValueError).

        A port still held for up to BIND_RETRY_S is waited for: ZeroMQ closes a socket asynchronously, so
        the previous sender of this process (a resumed lifetime) may release the port a moment late."""
        if cfg.port == 0:
            self._close_sockets()
            raise ValueError("transport.port = 0 (a free port) works only under `rl`: give a port")
        deadline = time.monotonic() + BIND_RETRY_S
        while True:
            try:
                self._router.bind(f"tcp://{cfg.host}:{cfg.port}")
                return
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EADDRINUSE and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                self._close_sockets()
                raise ValueError(
                    f"transport.port = {cfg.port} on {cfg.host}: {exc} (another run's orchestrator?): "
                    "choose another port, or run under `rl` with port = 0"
                ) from None

    def _close_sockets(self) -> None:
        self._router.close(linger=0)
        self._wake_pull.close(linger=0)
        if self._guard is not None:
            self._guard.close()

    # -- main-thread API -------------------------------------------------------------------------------
    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until every rank has sent its READY (first request)."""
        deadline = time.monotonic() + (self.cfg.timeout_s if timeout is None else timeout)
        while not self._all_ready.wait(timeout=0.05):
            self._raise_if_failed()
            if time.monotonic() > deadline:
                with self._lock:
                    missing = sorted(set(range(self.num_ranks)) - set(self._next_needed))
                raise TimeoutError(f"trainer ranks {missing} did not connect to the batch stream in time")
        self._raise_if_failed()

    def send(self, batch: TrainBatch) -> None:
        """Queue `batch` for its ranks (after the READY handshake of all ranks). Returns once cached."""
        self._raise_if_failed()
        if len(batch.micro_batches) != self.num_ranks:
            raise ValueError(f"batch has {len(batch.micro_batches)} rank slices, sender has {self.num_ranks}")
        if self._last_step is not None and batch.step != self._last_step + 1:
            raise ValueError(f"batch step {batch.step} does not follow {self._last_step}")
        self.wait_ready()
        frames = [encode_rank_slice(batch, rank) for rank in range(self.num_ranks)]
        with self._lock:
            self._cache[batch.step] = frames
            self._last_step = batch.step
            self._evict_locked()
        self._wake()

    @property
    def last_step(self) -> int | None:
        """Step of the newest batch `send` queued in this sender's lifetime (None before the first)."""
        with self._lock:
            return self._last_step

    def delivered_step(self) -> int | None:
        """Newest step whose slice every rank was sent (None before that happened in this lifetime)."""
        with self._lock:
            if len(self._delivered) < self.num_ranks:
                return None
            return min(self._delivered.values())

    def stop_serving(self) -> int | None:
        """Freeze the stream (a planned stop) and return the newest step any rank was sent (None: none
        in this lifetime). Atomic with the serving thread: a slice is chosen, handed to ZeroMQ and
        counted under the same lock, so the step returned is exactly what the trainer can have; from
        here on no step newer than it is answered (requests for them wait: the trainer asks again, and
        the resumed orchestrator answers). Steps up to it are still served, so a rank that has not
        fetched it yet (or lost the answer) still gets the very batch the planned-stop checkpoint counts
        as fetched. Idempotent: a second call returns the same step."""
        with self._lock:
            if self._frozen_at is None:
                self._frozen_at = max(self._delivered.values(), default=-1)
            return None if self._frozen_at < 0 else self._frozen_at

    def wait_delivered(self, step: int, timeout: float) -> bool:
        """Block until every rank was sent its slice of batch `step` (False on timeout).

        Called before `close()` at the end of a run: the stream is pull-based, so without it the last
        batch would die with the sender if the trainer asks for it only after the orchestrator finished.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._raise_if_failed()
            with self._lock:
                if all(self._delivered.get(rank, -1) >= step for rank in range(self.num_ranks)):
                    return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout=5)
        self._wake_push.close(linger=0)

    def __enter__(self) -> BatchSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------------
    def _wake(self) -> None:
        """Nudge the sender thread. Never blocks: a PUSH without a live peer (the thread already exited)
        would block forever, and a lost nudge costs at most one 200 ms poll."""
        with contextlib.suppress(zmq.Again):
            self._wake_push.send(b"", zmq.NOBLOCK)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"batch sender thread failed: {self._error}") from self._error

    def _evict_locked(self) -> None:
        oldest_needed = min(self._next_needed.values(), default=0)
        while len(self._cache) > self.resend_window:
            step = next(iter(self._cache))
            if step >= oldest_needed:
                break
            del self._cache[step]

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_pull, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(timeout=200))
                if self._wake_pull in events:
                    while self._wake_pull.poll(0):
                        self._wake_pull.recv()
                if self._router in events:
                    while self._router.poll(0):
                        self._on_message(self._router.recv_multipart())
                self._serve_pending()
        except BaseException as exc:  # supervised: re-raised in the main thread by send/wait_ready
            logger.exception("batch sender thread failed")
            self._error = exc
        finally:
            self._close_sockets()

    def _on_message(self, parts: list[bytes]) -> None:
        identity, frames = parts[0], parts[1:]
        try:
            if len(frames) != 1:
                raise WireError(f"expected 1 request frame, got {len(frames)}")
            msg = decode_message(frames[0])
            if not isinstance(msg, Request):
                raise WireError(f"expected a request, got {type(msg).__name__}")
            if msg.world_size != self.num_ranks or not 0 <= msg.rank < self.num_ranks:
                raise WireError(f"rank {msg.rank}/world {msg.world_size} != sender's {self.num_ranks} ranks")
        except WireError as exc:
            # A bad peer gets a clear error back; the stream keeps serving the good ones.
            logger.error("bad request on the batch stream: %s", exc)
            self._reply(identity, [encode_message(ErrorReply(step=-1, message=str(exc)))])
            return
        with self._lock:
            if msg.rank in self._next_needed and msg.step < self._next_needed[msg.rank]:
                logger.warning("trainer rank %d re-asked for step %d (restart?)", msg.rank, msg.step)
            self._next_needed[msg.rank] = msg.step
            for other in [i for i, r in self._pending.items() if r.rank == msg.rank]:
                del self._pending[other]  # the rank asked again from a fresh socket: answer that one
            self._pending[identity] = msg
            if len(self._next_needed) == self.num_ranks:
                self._all_ready.set()

    def _serve_pending(self) -> None:
        """Answer the pending requests that can be answered. Under the lock from choosing a reply to
        counting it delivered (`stop_serving` is atomic with it); a send to a ROUTER peer never blocks
        in practice (one outstanding request per peer, far below the high-water mark)."""
        with self._lock:
            for identity, req in list(self._pending.items()):
                if self._frozen_at is not None and req.step > self._frozen_at:
                    continue  # planned stop: the resumed orchestrator answers it
                if req.step in self._cache:
                    if self._reply(identity, self._cache[req.step][req.rank]):
                        self._delivered[req.rank] = max(self._delivered.get(req.rank, -1), req.step)
                elif self._last_step is None or req.step > self._last_step:
                    continue  # not produced yet
                else:
                    msg = f"batch {req.step} is no longer cached (oldest {next(iter(self._cache), None)}); "
                    msg += "raise transport.resend_window to at least the trainer's ckpt.interval"
                    self._reply(identity, [encode_message(ErrorReply(step=req.step, message=msg))])
                del self._pending[identity]
            self._evict_locked()

    def _reply(self, identity: bytes, frames: list) -> bool:
        """Hand `frames` to ZeroMQ for `identity`; False when the ROUTER no longer knows that peer."""
        try:
            self._router.send_multipart([identity, *frames], copy=False)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            # The requester died before its answer (e.g. a trainer being restarted); its successor will ask.
            logger.warning("trainer peer %r went away before its batch was sent", identity)
            return False
        return True


ASK_AGAIN_S = 5.0


class BatchReceiver:
    """Trainer rank side: DEALER with a fresh identity per process; `receive(step)` asks and waits."""

    def __init__(self, *, cfg: TransportConfig, rank: int, world_size: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self._sock = self._connect()

    def _connect(self) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"rank{self.rank}-{uuid.uuid4().hex[:12]}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        secure_client(sock, self.cfg)  # CURVE off loopback (curve.py)
        sock.connect(f"tcp://{self.cfg.host}:{self.cfg.port}")
        return sock

    def receive(self, step: int, timeout: float | None = None) -> RankBatch:
        """Request batch `step` and return this rank's slice; errors are raised, never skipped.

        Every `ASK_AGAIN_S` without an answer the request is sent again from a fresh socket: a request
        that reached an orchestrator which then stopped (a planned stop, restarted alone by `rl`) died
        with it. The previous socket stays open (and polled) for one more period: an answer the sender
        handed to ZeroMQ just before the fresh request arrived, which it counts as fetched, still
        arrives. Any answer is batch `step` of a lifetime that may serve it (a frozen sender serves no
        step newer than its planned-stop checkpoint), so whichever socket answers first is right."""
        req = Request(step=step, rank=self.rank, world_size=self.world_size)
        timeout_s = self.cfg.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout_s
        previous: zmq.Socket | None = None
        self._sock.send(encode_message(req))
        while (answered := self._poll(self._sock, previous, deadline)) is None:
            if previous is not None:
                previous.close(linger=0)
                previous = None
            if time.monotonic() >= deadline:
                raise TimeoutError(f"rank {self.rank}: no batch for step {step} within {timeout_s:.0f}s")
            previous, self._sock = self._sock, self._connect()
            self._sock.send(encode_message(req))
        if previous is not None:  # the other socket's late answer (if any) is not wanted
            (self._sock if answered is previous else previous).close(linger=0)
        self._sock = answered
        frames = [f.buffer for f in self._sock.recv_multipart(copy=False)]
        first = decode_message(frames[0])
        if isinstance(first, ErrorReply):
            raise RuntimeError(f"orchestrator refused batch {step} for rank {self.rank}: {first.message}")
        header, micro_batches = decode_rank_slice(frames, max_frame_bytes=self.cfg.max_frame_bytes)
        if header.step != step or header.rank != self.rank or header.world_size != self.world_size:
            raise WireError(
                f"asked for step {step} rank {self.rank}/{self.world_size}, "
                f"got step {header.step} rank {header.rank}/{header.world_size}"
            )
        return RankBatch(
            step=header.step,
            rank=header.rank,
            micro_batches=micro_batches,
            layout=header.layout,
            num_loss_tokens=header.num_loss_tokens,
            temperature=header.temperature,
            min_dispatch_version=header.min_dispatch_version,
            max_dispatch_version=header.max_dispatch_version,
            metrics=dict(header.metrics),
            teacher_kl_weight=header.teacher_kl_weight,
        )

    @staticmethod
    def _poll(sock: zmq.Socket, previous: zmq.Socket | None, deadline: float) -> zmq.Socket | None:
        """The socket (current or previous) with an answer within `ASK_AGAIN_S` (or the deadline)."""
        poller = zmq.Poller()
        for s in (sock, previous):
            if s is not None:
                poller.register(s, zmq.POLLIN)
        wait_ms = int(1000 * max(0.0, min(ASK_AGAIN_S, deadline - time.monotonic())))
        ready = dict(poller.poll(timeout=wait_ms))
        return sock if sock in ready else previous if previous in ready else None

    def close(self) -> None:
        self._sock.close(linger=0)
