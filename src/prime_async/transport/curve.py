"""ZeroMQ CURVE on the batch stream and the control channel: when it is on, the keys, and the sockets' setup.

    orchestrator (binds)                                   trainer ranks (connect)
      ROUTER: CURVE_SERVER, server secret key,               DEALER: client key pair + the server's
      ZAP domain -> `zap.py` admits the client key only      public key (handshake fails otherwise)

Keys live in one directory (`transport.curve_keys_dir`; `rl` generates it as `output_dir/transport_keys`):
`server.key` / `server.key_secret` and `client.key` / `client.key_secret` (pyzmq's certificate files).
The orchestrator reads `server.key_secret` and `client.key`, a trainer rank `client.key_secret` and
`server.key`, so a trainer node needs no server secret.

Invariants:
- CURVE is on when `transport.curve = "on"` or `transport.host` is not loopback (`"auto"`); a loopback
  bind with `"auto"` is plain TCP exactly as before (no keys, no ZAP);
- CURVE on without keys is refused before the component starts (`check_keys`: one line, exit 2);
- a generated directory is 0700 and its files 0600; a secret key file readable by others is refused;
- a server socket gets its ZAP domain before it binds, so no peer is admitted without the ZAP check.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from prime_async.config.shared import TransportConfig
from prime_async.transport.zap import ZapRegistration, register_domain

KEYS_DIRNAME = "transport_keys"
SERVER, CLIENT = "server", "client"
LOOPBACK_NAMES = {"localhost"}


def is_loopback(host: str) -> bool:
    """`host` is a loopback address (127.0.0.0/8, ::1) or `localhost`."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve off this machine


def curve_on(cfg: TransportConfig) -> bool:
    """CURVE is on: forced, or (auto) the sockets bind a non-loopback address."""
    return cfg.curve == "on" or not is_loopback(cfg.host)


def _refusal(cfg: TransportConfig) -> str:
    if not is_loopback(cfg.host):
        return (
            f"transport.host = {cfg.host!r} is not loopback: set transport.curve_keys_dir (or bind 127.0.0.1)"
        )
    return "transport.curve = 'on': set transport.curve_keys_dir"


def check_keys(cfg: TransportConfig, *, side: str) -> None:
    """Raise ValueError (one line) when CURVE is on and `side`'s key files ("server": the orchestrator,
    "client": a trainer rank) are missing or readable by other users; nothing when CURVE is off."""
    if not curve_on(cfg):
        return
    if cfg.curve_keys_dir is None:
        raise ValueError(_refusal(cfg))
    own, peer = (SERVER, CLIENT) if side == SERVER else (CLIENT, SERVER)
    secret = Path(cfg.curve_keys_dir) / f"{own}.key_secret"
    for path in (secret, Path(cfg.curve_keys_dir) / f"{peer}.key"):
        if not path.is_file():
            raise ValueError(f"transport.curve_keys_dir: {path} is missing (`rl` generates the directory)")
    if secret.stat().st_mode & 0o077:
        raise ValueError(f"transport.curve_keys_dir: {secret} is readable by other users: chmod 600 it")


def generate_keys(directory: Path) -> Path:
    """Create `directory` (0700) with a server and a client key pair (0600 files); returns it. An existing
    directory is kept as is (a restarted run keeps its keys)."""
    directory = Path(directory)
    if (directory / f"{SERVER}.key_secret").is_file() and (directory / f"{CLIENT}.key_secret").is_file():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))  # 0700
    try:
        for name in (SERVER, CLIENT):
            zmq.auth.create_certificates(tmp, name)
        for path in tmp.iterdir():
            path.chmod(0o600)
        tmp.chmod(0o700)
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


@dataclass(frozen=True)
class ServerGuard:
    """A server socket's CURVE setup; `close()` (after the socket is closed) drops its ZAP domain."""

    registration: ZapRegistration

    def close(self) -> None:
        self.registration.close()


def secure_server(sock: zmq.Socket, cfg: TransportConfig, *, label: str) -> ServerGuard | None:
    """Make `sock` (not bound yet) a CURVE server that admits only the client key; None when CURVE is off.
    `label` names the socket in the ZAP handler's log lines ("batch stream", "control channel")."""
    if not curve_on(cfg):
        return None
    check_keys(cfg, side=SERVER)
    keys = Path(cfg.curve_keys_dir or "")
    _, server_secret = zmq.auth.load_certificate(keys / f"{SERVER}.key_secret")
    client_public, _ = zmq.auth.load_certificate(keys / f"{CLIENT}.key")
    domain = f"prime-async-{label.replace(' ', '-')}-{uuid.uuid4().hex[:8]}"
    registration = register_domain(sock.context, domain, allowed={client_public}, label=label, sock=sock)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, server_secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: refuse, never admit everyone
    return ServerGuard(registration)


def secure_client(sock: zmq.Socket, cfg: TransportConfig) -> None:
    """Give `sock` (not connected yet) the client key pair and the server's public key when CURVE is on."""
    if not curve_on(cfg):
        return
    check_keys(cfg, side=CLIENT)
    keys = Path(cfg.curve_keys_dir or "")
    client_public, client_secret = zmq.auth.load_certificate(keys / f"{CLIENT}.key_secret")
    server_public, _ = zmq.auth.load_certificate(keys / f"{SERVER}.key")
    sock.setsockopt(zmq.CURVE_PUBLICKEY, client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, client_secret or b"")
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
