"""The ZAP handler of CURVE server sockets: admits a domain's client key, refuses and logs every other peer.

ZeroMQ asks one handler per context (`inproc://zeromq.zap.01`) whether a peer that completed the CURVE
handshake may talk to a socket; the socket names its ZAP domain (`curve.secure_server`). A peer that
fails the handshake itself (no keys, or not this run's server key) never reaches ZAP: the socket's
monitor reports it, and the same thread logs it.

    server socket ──ZAP request (domain, peer address, client key)──► handler thread ──► 200 / 400
    server socket ──monitor: handshake failed──────────────────────► handler thread ──► one log line

Invariants:
- one handler thread per libzmq context while at least one domain is registered; the last `close()`
  stops it (the inproc endpoint is free again for the next one);
- a registered domain admits exactly its `allowed` client keys; an unknown domain admits only the NULL
  mechanism (plain loopback sockets that share the context are not affected);
- every refused peer is logged at WARNING, one line naming the socket and the peer, at most once per
  `LOG_EVERY_S` per (socket, peer, reason) with the count since (a retrying peer does not flood the log).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
LOG_EVERY_S = 30.0
HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_monitor_ids = itertools.count()
HANDSHAKE_ERRORS = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "no CURVE keys",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "not this run's server key",
}


@dataclass
class _Domain:
    allowed: frozenset[bytes]  # z85 public keys
    label: str
    monitor: zmq.Socket | None = None  # PAIR on the socket's monitor endpoint (handler thread reads)


@dataclass
class _RefusalLog:
    """Rate-limited WARNING lines about refused peers."""

    seen: dict[tuple[str, str, str], tuple[int, float]] = field(default_factory=dict)

    def refused(self, label: str, peer: str, why: str) -> None:
        count, last = self.seen.get((label, peer, why), (0, -LOG_EVERY_S))
        now = time.monotonic()
        if now - last >= LOG_EVERY_S:
            since = f" ({count} more refusals since the last line)" if count else ""
            logger.warning(
                "%s: refused a peer at %s (%s): nothing from it is read%s", label, peer, why, since
            )
            self.seen[(label, peer, why)] = (0, now)
        else:
            self.seen[(label, peer, why)] = (count + 1, last)


class _Handler:
    """The ZAP handler of one context: a REP socket on the ZAP endpoint served by one daemon thread."""

    def __init__(self, address: int):
        self.ctx = zmq.Context.shadow(address)
        self.lock = threading.Lock()
        self.domains: dict[str, _Domain] = {}
        self.to_close: list[zmq.Socket] = []
        self.log = _RefusalLog()
        self._rep = self.ctx.socket(zmq.REP)
        self._rep.setsockopt(zmq.LINGER, 0)
        self._rep.bind(ZAP_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zap-handler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                monitors = self._monitors()
                poller = zmq.Poller()
                poller.register(self._rep, zmq.POLLIN)
                for sock in monitors:
                    poller.register(sock, zmq.POLLIN)
                events = dict(poller.poll(timeout=100))
                if self._rep in events:
                    self._rep.send_multipart(self._answer(self._rep.recv_multipart()))
                for sock, label in monitors.items():
                    if sock in events:
                        self._on_monitor_event(sock, label)
        except Exception:  # a dead handler refuses everyone (ZAP_ENFORCE_DOMAIN): say why, loudly
            logger.exception("ZAP handler failed: CURVE peers are refused from now on")
        finally:
            self._rep.close(linger=0)
            with self.lock:
                for sock in [*self.to_close, *(d.monitor for d in self.domains.values() if d.monitor)]:
                    sock.close(linger=0)

    def _monitors(self) -> dict[zmq.Socket, str]:
        """The live monitor sockets (closing the ones of unregistered domains, in this thread)."""
        with self.lock:
            for sock in self.to_close:
                sock.close(linger=0)
            self.to_close.clear()
            return {d.monitor: d.label for d in self.domains.values() if d.monitor is not None}

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        """The ZAP reply (RFC 27) to one request."""
        if len(frames) < 6:
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"malformed ZAP request", b"", b""]
        _, request_id, domain, address, _identity, mechanism, *credentials = frames
        with self.lock:
            entry = self.domains.get(domain.decode(errors="replace"))
        peer = address.decode(errors="replace") or "an unknown address"
        if entry is None:
            ok = mechanism == b"NULL"
        elif mechanism == b"CURVE" and credentials and len(credentials[0]) == 32:
            ok = z85.encode(credentials[0]) in entry.allowed
            if not ok:
                self.log.refused(entry.label, peer, "its CURVE key is not this run's client key")
        else:
            ok = False
            self.log.refused(entry.label, peer, f"mechanism {mechanism.decode(errors='replace')}, not CURVE")
        status = [b"200", b"OK"] if ok else [b"400", b"refused"]
        return [b"1.0", request_id, *status, b"", b""]

    def _on_monitor_event(self, sock: zmq.Socket, label: str) -> None:
        event = recv_monitor_message(sock)
        if event["event"] & HANDSHAKE_EVENTS:
            endpoint = event["endpoint"].decode(errors="replace")
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # value: an errno
                reason = f"the connection ended during it ({os.strerror(event['value'])})"
            else:
                reason = HANDSHAKE_ERRORS.get(event["value"], f"protocol error {event['value']:#x}")
            why = f"CURVE handshake failed: {reason}"
            self.log.refused(label, f"an address on {endpoint}", why)


_handlers: dict[int, _Handler] = {}
_handlers_lock = threading.Lock()


@dataclass(frozen=True)
class ZapRegistration:
    """A registered domain; `close()` drops it (and stops the handler after the last one)."""

    address: int
    domain: str

    def close(self) -> None:
        with _handlers_lock:
            handler = _handlers.get(self.address)
            if handler is None:
                return
            with handler.lock:
                entry = handler.domains.pop(self.domain, None)
                if entry is not None and entry.monitor is not None:
                    handler.to_close.append(entry.monitor)
                last = not handler.domains
            if last:
                del _handlers[self.address]
                handler.stop()


def register_domain(
    ctx: zmq.Context, domain: str, *, allowed: set[bytes], label: str, sock: zmq.Socket | None = None
) -> ZapRegistration:
    """Admit `allowed` (z85 public keys) on ZAP domain `domain` of `ctx`; with `sock`, its failed
    handshakes are logged too (call before it binds)."""
    address = ctx.underlying
    with _handlers_lock:
        handler = _handlers.get(address)
        if handler is None:
            handler = _handlers[address] = _Handler(address)
        monitor = None
        if sock is not None:
            endpoint = f"inproc://zap-monitor-{next(_monitor_ids)}"
            sock.monitor(endpoint, HANDSHAKE_EVENTS)
            monitor = handler.ctx.socket(zmq.PAIR)
            monitor.setsockopt(zmq.LINGER, 0)
            monitor.connect(endpoint)
        with handler.lock:
            handler.domains[domain] = _Domain(frozenset(allowed), label, monitor)
    return ZapRegistration(address, domain)
