"""DataSource units: epochs, retries, resume of issued-not-trained prompts, streamed tasksets."""

from __future__ import annotations

import pytest

from prime_async.orchestrator.data_source import DataSource
from prime_async.rollouts.tasks import LazyTasks


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


def test_streamed_source_draws_in_order_and_resumes_at_the_drawn_count():
    data = DataSource(num_examples=None, seed=3)
    assert [data.next_example() for _ in range(5)] == [(i, 0) for i in range(5)]
    state = data.state_dict(pending=[(3, 0), (4, 0)])  # issued, not trained
    assert state["position"] == 5 and state["num_examples"] is None
    resumed = DataSource(num_examples=None, seed=3)
    resumed.load_state_dict(state)
    assert [resumed.next_example() for _ in range(4)] == [(3, 0), (4, 0), (5, 0), (6, 0)]
    with pytest.raises(ValueError, match="None = streamed"):
        DataSource(num_examples=10).load_state_dict(state)


def test_lazy_tasks_draw_only_what_is_asked_and_rewind_for_old_ids():
    made: list[int] = []

    def tasks():
        def gen():
            i = 0
            while True:  # an infinite taskset
                made.append(i)
                yield f"task-{i}"
                i += 1

        return gen()

    lazy = LazyTasks(tasks, cache_size=3)
    assert lazy[0] == "task-0" and lazy[2] == "task-2"
    assert made == [0, 1, 2], "nothing is drawn past the asked id"
    assert lazy[1] == "task-1" and lazy.num_rewinds == 0  # still cached
    assert lazy[6] == "task-6" and lazy[1] == "task-1"  # evicted: re-read from the start
    assert lazy.num_rewinds == 1
    finite = LazyTasks(lambda: iter(["a"]))
    with pytest.raises(IndexError, match="ended after 1 tasks"):
        finite[1]
