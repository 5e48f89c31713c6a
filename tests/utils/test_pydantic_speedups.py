"""The memoized default-factory check answers as pydantic does, and model_construct still fills defaults."""

from __future__ import annotations

import time

from pydantic import BaseModel, Field
from pydantic._internal import _fields

from prime_async.utils import pydantic_speedups


class _Node(BaseModel):
    ids: list[int] = Field(default_factory=list)
    stamp: float = Field(default_factory=time.time)
    copy_of_ids: list[int] = Field(default_factory=lambda data: list(data["ids"]))


def test_install_is_in_place_and_idempotent() -> None:
    assert pydantic_speedups.install()
    wrapped = _fields.takes_validated_data_argument
    assert pydantic_speedups.install()
    assert _fields.takes_validated_data_argument is wrapped


def test_memoized_answers_match_pydantic() -> None:
    pydantic_speedups.install()
    check = _fields.takes_validated_data_argument
    original = check.__wrapped__
    factories = [list, dict, time.time, lambda: 1, lambda data: data, _Node]
    for factory in factories:
        assert check(factory) == original(factory), factory
        assert check(factory) == original(factory), factory  # second (cached) answer too


def test_unhashable_factory_falls_through() -> None:
    pydantic_speedups.install()

    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self) -> int:
            return 1

    factory = Unhashable()
    check = _fields.takes_validated_data_argument
    assert check(factory) == check.__wrapped__(factory)


def test_model_construct_fills_defaults_after_install() -> None:
    pydantic_speedups.install()
    a = _Node.model_construct(ids=[1, 2])
    b = _Node.model_construct()
    assert a.ids == [1, 2] and b.ids == [] and a.ids is not b.ids
    assert isinstance(b.stamp, float)
    assert _Node(ids=[3]).copy_of_ids == [3]  # validated-data factories still get the data
