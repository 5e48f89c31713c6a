"""The weight transports: the `WeightTransport` literal is written once (`prime_async/types.py`), and every
value has one publisher (trainer side, `weights/publishers/`) and one loader (orchestrator side,
`weights/loaders/`), so adding a transport is one value plus one file per side."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

from prime_async.types import WeightTransport

SRC = Path(__file__).resolve().parents[2] / "src" / "prime_async"
VALUES = get_args(WeightTransport)
NAME = "|".join(VALUES)
OWN = "|".join(v for v in VALUES if v != "shared")  # "shared" is also an eval placement's value
ONE, OWN_ONE = rf"[\"']({NAME})[\"']", rf"[\"']({OWN})[\"']"
# a Literal naming a transport of its own or two transports, or two transports listed together (a
# tuple, list or set of the values)
SPELLED = re.compile(rf"Literal\[[^\]]*({OWN_ONE}|{ONE}[^\]]*{ONE})|{ONE}\s*,\s*{ONE}")


def test_the_transport_literal_is_written_once() -> None:
    places = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if SPELLED.search(p.read_text()))
    assert places == ["types.py"], f"weight transports spelled out in {places}; use prime_async.types"


def test_the_pattern_sees_a_second_spelling() -> None:
    assert SPELLED.search('transport: Literal["filesystem", "nixl"] = "filesystem"')
    assert SPELLED.search('if transport in ("shared", "distributed"):')
    assert not SPELLED.search('if cfg.weights.transport == "shared":')
    assert not SPELLED.search('placement: Literal["shared", "dedicated", "external"]')


def test_every_transport_has_one_publisher_and_one_loader() -> None:
    from prime_async.weights.loaders import LOADERS
    from prime_async.weights.publishers import PUBLISHERS

    assert set(PUBLISHERS) == set(VALUES), "a transport without a trainer-side publisher"
    assert set(LOADERS) == set(VALUES), "a transport without an orchestrator-side loader"
    assert all(cls.transport == name for name, cls in PUBLISHERS.items())
