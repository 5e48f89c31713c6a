"""DataSource and Ledger units: epochs, retries, resume of issued-not-trained prompts; ledger balance."""

from __future__ import annotations

import pytest

from prime_async.orchestrator.data_source import DataSource
from prime_async.orchestrator.ledger import Ledger


def test_each_epoch_issues_every_example_once():
    ds = DataSource(num_examples=5, seed=3)
    first = [ds.next_example() for _ in range(10)]
    assert sorted(e for e, ep in first if ep == 0) == list(range(5))
    assert sorted(e for e, ep in first if ep == 1) == list(range(5))
    assert [e for e, _ in first[:5]] != [e for e, _ in first[5:]]  # reshuffled per epoch


def test_retry_comes_first():
    ds = DataSource(num_examples=5, seed=0, shuffle=False)
    ds.next_example()
    ds.retry(0, 0)
    assert ds.next_example() == (0, 0)
    assert ds.next_example() == (1, 0)


def test_state_roundtrip_reissues_pending():
    ds = DataSource(num_examples=6, seed=1)
    issued = [ds.next_example() for _ in range(4)]
    state = ds.state_dict(pending=issued[2:])  # issued[0:2] were trained
    ds2 = DataSource(num_examples=6, seed=1)
    ds2.load_state_dict(state)
    rest = [ds2.next_example() for _ in range(4)]
    assert rest[:2] == issued[2:]
    assert sorted(e for e, _ in issued[:2] + rest) == list(range(6))


def test_state_from_other_dataset_is_rejected():
    state = DataSource(num_examples=3).state_dict()
    with pytest.raises(ValueError, match="same env config"):
        DataSource(num_examples=4).load_state_dict(state)


def test_ledger_balances_and_checks_against_observed_counts():
    led = Ledger()
    led.dispatch(8)
    led.move(4, "inflight", "buffered")
    led.move(2, "inflight", "cancelled")
    led.check(inflight=2, buffered=4)
    with pytest.raises(RuntimeError, match="disagrees"):
        led.check(inflight=3, buffered=4)
    with pytest.raises(AssertionError):
        led.move(5, "buffered", "trained")
    led.counts["trained"] += 1  # a bug somewhere: an episode counted twice
    with pytest.raises(RuntimeError, match="unbalanced"):
        led.check(inflight=2, buffered=4)
