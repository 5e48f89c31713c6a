"""AdmissionController over a real GroupTable: both caps, the K rule, granularity, hold, wait accounting."""

from __future__ import annotations

from prime_async.orchestrator.admission import AdmissionController
from prime_async.orchestrator.data_source import DataSource
from prime_async.orchestrator.groups import GroupTable
from prime_async.orchestrator.types import Group
from prime_async.rollouts.types import Episode


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(clock=None, k: int = 1, batch_groups: int = 4, **kw) -> AdmissionController:
    data = DataSource(num_examples=100, seed=0, shuffle=False)
    groups = GroupTable(group_size=2, batch_groups=batch_groups, max_off_policy_steps=k, data=data,
                        retry_unused=False, max_dropped_groups_per_step=100)  # fmt: skip
    args = dict(max_inflight_groups=2, max_buffered_groups=3, granularity="group")
    args.update(kw)
    return AdmissionController(groups=groups, **args, clock=clock or FakeClock())


def dispatch(adm: AdmissionController) -> Group:
    group = Group(group_id=adm.groups.dispatched, example_id=0, dispatch_version=adm.served_version)
    adm.groups.dispatch(group)
    return group


def episodes_return(adm: AdmissionController, group: Group) -> None:
    for _ in range(2):
        adm.groups.episode_done(group)
    group.episodes = [Episode(example_id=0), Episode(example_id=0)]


def buffer(adm: AdmissionController, group: Group) -> None:
    episodes_return(adm, group)
    adm.groups.finish(group)
    adm.groups.accept(group)


def test_inflight_cap_group_granularity():
    adm = make()
    assert adm.poll() is None
    first = dispatch(adm)
    dispatch(adm)
    assert adm.poll() == "inflight_limit"
    episodes_return(adm, first)  # a whole group's episodes finished, but the group has not returned
    adm.groups.finish(first)
    assert adm.poll() == "inflight_limit"
    adm.groups.drop(first, "errored")  # the sink ended it
    assert adm.poll() is None


def test_inflight_cap_sample_granularity_frees_per_episode():
    adm = make(granularity="sample")
    a, b = dispatch(adm), dispatch(adm)
    assert adm.poll() == "inflight_limit"
    adm.groups.episode_done(a)  # one episode of group A and one of group B: group_size samples free
    adm.groups.episode_done(b)
    assert adm.poll() is None


def test_buffer_cap_counts_inflight_plus_buffered():
    adm = make(max_inflight_groups=10)
    groups = [dispatch(adm) for _ in range(3)]
    buffer(adm, groups[0])
    buffer(adm, groups[1])
    assert adm.poll() == "buffer_full"  # 1 in flight + 2 buffered + 1 > 3
    adm.groups.take([groups[0]], step=0)
    assert adm.poll() is None


def test_k_rule_reads_the_next_batch_step_of_the_group_table():
    adm = make(k=1)
    adm.groups.take([], step=0)  # next batch is 1, served 0: 1 - 0 <= 1
    assert adm.poll() is None
    adm.groups.take([], step=1)  # next batch is 2: a group stamped 0 could never ship
    assert adm.poll() == "off_policy"
    adm.set_served_version(1)
    assert adm.poll() is None


def test_landing_rule_admits_only_what_can_ship():
    """A new group lands in batch next + live // batch_groups; it is admitted only within K of served."""
    adm = make(k=1, batch_groups=2, max_inflight_groups=10, max_buffered_groups=10)
    live = []
    while adm.poll() is None:
        live.append(dispatch(adm))
    assert len(live) == 4 and adm.poll() == "off_policy"  # batches 0 and 1, both within K = 1 of version 0
    buffer(adm, live[0])
    buffer(adm, live[1])
    adm.groups.take(live[:2], step=0)  # next batch is 1, still served 0: one batch more can ship, and
    assert adm.poll() == "off_policy"  # the two groups in flight fill it
    adm.set_served_version(1)  # they land in batch 1, a new group in batch 2 = 1 + K
    assert adm.poll() is None
    dispatch(adm), dispatch(adm)
    assert adm.poll() == "off_policy"


def test_hold_blocks_until_released():
    adm = make()
    adm.hold()
    assert adm.poll() == "hold"
    adm.release()
    assert adm.poll() is None


def test_wait_fractions_of_the_step_window():
    clock = FakeClock()
    adm = make(clock=clock, max_inflight_groups=1, max_buffered_groups=2)
    group = dispatch(adm)
    assert adm.poll() == "inflight_limit"  # blocked from t=0
    clock.now = 3.0
    buffer(adm, group)
    assert adm.poll() is None
    dispatch(adm)
    assert adm.poll() == "buffer_full"  # 3 s in-flight limit, then buffer full from t=3
    clock.now = 4.0
    m = adm.metrics()
    assert m["rollout/buffer/admission_wait_inflight_limit"] == 0.75
    assert m["rollout/buffer/admission_wait_buffer_full"] == 0.25
    clock.now = 8.0  # still blocked by the buffer for the whole next window
    m = adm.metrics()
    assert m["rollout/buffer/admission_wait_buffer_full"] == 1.0
    assert m["rollout/buffer/admission_wait_inflight_limit"] == 0.0


def test_changed_event_is_set_on_every_capacity_change():
    adm = make()
    group = dispatch(adm)
    for change in (
        lambda: adm.groups.episode_done(group),
        lambda: adm.groups.take([], step=3),
        lambda: adm.set_served_version(2),
        adm.notify,
    ):
        adm.changed.clear()
        change()
        assert adm.changed.is_set()
