"""Ports that `rl` picks lie where no other process is handed them by the kernel.

The CI failure this guards against: `rl` asked the kernel for a free port (bind to 0), released it, and
before the orchestrator bound its control channel there, another process of the run got the same port
from the kernel (bind to 0 or an outgoing connection): `zmq.error.ZMQError: Address already in use`.
"""

from __future__ import annotations

import random
import socket

from prime_async.config.rl import RLConfig
from prime_async.launcher.identity import _ephemeral_low, free_ports, resolve_run, run_ports


def test_picked_ports_are_free_below_the_ephemeral_range_and_clear_of_sglang() -> None:
    low = _ephemeral_low()
    for count in (1, 2, 4):
        base = free_ports("127.0.0.1", count)
        ports = range(base, base + count)
        assert all(10000 <= p < min(22000, low) for p in ports)  # SGLang picks in 22000-29999 itself
        for p in ports:  # free: we can listen there
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))


def test_a_seeded_global_random_does_not_make_two_runs_pick_alike() -> None:
    picks = set()
    for _ in range(3):
        random.seed(0)  # what a deterministic run does in its own process
        picks.add(free_ports("127.0.0.1", 1))
    assert len(picks) > 1  # with the global random, all three would be one port


def test_resolve_run_gives_every_port_of_the_run_a_number_in_the_pick_range() -> None:
    cfg = RLConfig.model_validate(
        {
            "inference": {"server": {"port": 0}},
            "transport": {"port": 0},
            "weights": {"master_port": 0, "transport": "distributed"},
        }
    )
    resolved = resolve_run(cfg)
    ports = [p.port for p in run_ports(resolved)]
    assert len(set(ports)) == len(ports)
    assert all(10000 <= p < 22000 for p in ports), ports


def test_ports_picked_for_one_run_never_coincide(monkeypatch) -> None:
    """Nothing listens on a picked port until its process starts, so a free-port check alone would let
    two sections of one run (the rollout and the eval engine, both 0) get the same port."""
    import prime_async.launcher.identity as identity

    class SameOrder(random.Random):  # every pick sees the same candidates in the same order
        def sample(self, population, k):  # type: ignore[override]
            return list(population)[:k]

    monkeypatch.setattr(identity, "_pick_random", SameOrder())
    cfg = RLConfig.model_validate(
        {
            "inference": {"server": {"port": 0}},
            "eval_inference": {"server": {"port": 0}},
            "orchestrator": {"eval": {"placement": "dedicated", "envs": [{"id": "reverse-text"}]}},
            "transport": {"port": 0},
        }
    )
    ports = [p.port for p in run_ports(resolve_run(cfg))]
    assert len(set(ports)) == len(ports), ports
