"""Run identity and ports of `rl`: a run id for every engine, free ports checked before anything starts.

Called by `launcher/rl.py` before it writes the sub-configs and after inference is healthy.

Invariants:
- `resolve_run(cfg)` returns a config whose `run_id` is set and whose ports are all concrete: a port of
  0 is replaced by a free one below the kernel's ephemeral range (the inference engines get
  `num_engines` consecutive free ports), so no other process is handed it before its component binds it;
- `check_ports_free(cfg)` raises ValueError naming the first port some other process listens on (and what
  answers there, when it speaks the engine API) before any process of the run exists;
- `check_engine_identity` raises RuntimeError unless every engine is this run's: the embedded engine
  reports our run id in `/model_info`; SGLang, which has no such field, must serve our model path.
"""

from __future__ import annotations

import json
import random
import socket
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from prime_async.config.inference import InferenceConfig
from prime_async.config.rl import ENGINE_SECTIONS, RLConfig, engine_urls, explicit_values

_CONNECT_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1"}


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def port_is_free(host: str, port: int) -> bool:
    """True when we could bind `host:port` now (SO_REUSEADDR, as uvicorn and ZeroMQ bind)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


# Ports `rl` picks lie below the kernel's ephemeral range, so no bind(0) and no outgoing connection of
# any process (SGLang's scheduler, gloo, an HTTP client) can be handed one between the pick and the bind,
# and below 22000, where SGLang picks its own ports (`get_free_port_below_ephemeral`: 22000-29999).
_PICK_LOW, _PICK_HIGH = 10000, 21999
_pick_random = random.SystemRandom()  # never the run's seeded `random`: two runs must not pick alike


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other kernels differ, and the kernel fallback below covers them


def _kernel_free_ports(host: str, count: int) -> int:
    for _ in range(100):
        with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            base = sock.getsockname()[1]
        if base + count <= 65536 and all(port_is_free(host, base + i) for i in range(count)):
            return base
    raise RuntimeError(f"found no {count} consecutive free ports on {host}")


def free_ports(host: str, count: int, avoid: frozenset[int] = frozenset()) -> int:
    """First of `count` consecutive ports that are free on `host` and not in `avoid` (ports picked
    earlier for the same run, which nothing listens on yet).

    Picked at random in 10000-21999 when that lies below the kernel's ephemeral range (the usual case):
    a port there is only ever taken by a process that asks for it by number. Otherwise (a kernel whose
    ephemeral range starts low) the kernel picks, and a port can be taken before its process binds it."""
    high = min(_PICK_HIGH, _ephemeral_low() - 1) - count + 1
    if high - _PICK_LOW < 1000:
        for _ in range(100):
            base = _kernel_free_ports(host, count)
            if avoid.isdisjoint(range(base, base + count)):
                return base
        raise RuntimeError(f"found no {count} consecutive free ports on {host} outside {sorted(avoid)}")
    for base in _pick_random.sample(range(_PICK_LOW, high + 1), 200):
        ports = range(base, base + count)
        if avoid.isdisjoint(ports) and all(port_is_free(host, p) for p in ports):
            return base
    raise RuntimeError(f"found no {count} consecutive free ports on {host} in {_PICK_LOW}-{_PICK_HIGH}")


def describe_listener(host: str, port: int) -> str:
    """What answers on `host:port`, in a few words (an engine's model, version and run id, if it is one)."""
    host = _CONNECT_HOSTS.get(host, host)
    url_host = f"[{host}]" if ":" in host else host
    try:
        with urllib.request.urlopen(f"http://{url_host}:{port}/model_info", timeout=2) as response:
            info = json.loads(response.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError, OSError):
        return "a process that does not answer the engine API (GET /model_info)"
    run = info.get("run_id")
    return (
        f"an inference engine serving {info.get('model_path')!r} at weight version "
        f"{info.get('weight_version')!r}" + (f" for run {run}" if run else "")
    )


@dataclass(frozen=True)
class RunPort:
    key: str  # the TOML key that sets it
    host: str
    port: int


def _num_engines(inference: InferenceConfig) -> int:
    return inference.sglang.num_engines if inference.backend == "sglang" else 1


def run_ports(cfg: RLConfig) -> list[RunPort]:
    """Every port the run binds: the engines' HTTP ports (eval engines too), the batch stream, the control
    channel and (distributed weights) the weight process group's rendezvous."""
    sections = [(name, getattr(cfg, name)) for name in ENGINE_SECTIONS if getattr(cfg, name) is not None]
    ports = [
        RunPort(f"{name}.server.port" + (f" + {i}" if i else ""), inf.server.host, inf.server.port + i)
        for name, inf in sections
        for i in range(_num_engines(inf))
    ]
    ports.append(RunPort("transport.port", cfg.transport.host, cfg.transport.port))
    control = cfg.weights.resolved_control_port(cfg.transport)
    key = "weights.control_port" if cfg.weights.control_port is not None else "transport.port + 1"
    ports.append(RunPort(f"{key} (control channel)", cfg.transport.host, control))
    if cfg.weights.transport == "distributed":
        ports.append(RunPort("weights.master_port", cfg.weights.master_address, cfg.weights.master_port))
    return ports


def resolve_run(cfg: RLConfig) -> RLConfig:
    """`cfg` with a run id and concrete ports (0 = a free port), re-validated so every section agrees."""
    data = explicit_values(cfg)
    data["run_id"] = cfg.run_id or new_run_id()
    taken = {p.port for p in run_ports(cfg) if p.port != 0}

    def pick(host: str, count: int) -> int:
        """Free ports for this run, never one it already uses or picked (none is bound yet)."""
        base = free_ports(host, count, avoid=frozenset(taken))
        taken.update(range(base, base + count))
        return base

    for name in ENGINE_SECTIONS:
        inference = getattr(cfg, name)
        if inference is not None and inference.server.port == 0:
            port = pick(inference.server.host, _num_engines(inference))
            data.setdefault(name, {}).setdefault("server", {})["port"] = port
    if cfg.transport.port == 0:  # and the control channel's transport.port + 1 unless it has its own
        count = 2 if cfg.weights.control_port is None else 1
        data.setdefault("transport", {})["port"] = pick(cfg.transport.host, count)
    if cfg.weights.master_port == 0:
        data.setdefault("weights", {})["master_port"] = pick(cfg.weights.master_address, 1)
    return RLConfig.model_validate(data)


def check_ports_free(cfg: RLConfig) -> None:
    """Raise ValueError naming the first port of the run that another process already listens on."""
    for run_port in run_ports(cfg):
        if not port_is_free(run_port.host, run_port.port):
            raise ValueError(
                f"{run_port.key} = {run_port.port} is in use on {run_port.host} "
                f"({describe_listener(run_port.host, run_port.port)}): stop that process, choose another "
                "port, or set the port to 0 to let rl pick free ones"
            )


def _model_info(url: str, api_key: str | None) -> dict:
    request = urllib.request.Request(f"{url}/model_info")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def check_engine_identity(cfg: RLConfig, inference: InferenceConfig | None = None) -> None:
    """Raise RuntimeError unless every engine at the run's URLs (of `inference`, default the training
    engines) belongs to this run."""
    inference = inference or cfg.inference
    for url in engine_urls(explicit_values(inference)):
        info = _model_info(url, inference.server.api_key)
        reported = info.get("run_id")
        if reported is not None and reported != cfg.run_id:
            raise RuntimeError(f"the engine at {url} belongs to run {reported}, not to this run {cfg.run_id}")
        if reported is None and str(info.get("model_path")) != str(inference.model.path):
            raise RuntimeError(
                f"the engine at {url} serves {info.get('model_path')!r}, not this run's model "
                f"{str(inference.model.path)!r}: another server answers on its port"
            )
        if str(info.get("weight_version")) != str(inference.weight_version):
            raise RuntimeError(
                f"the engine at {url} serves weight version {info.get('weight_version')!r}, not this run's "
                f"initial version {inference.weight_version}: another server answers on its port"
            )
