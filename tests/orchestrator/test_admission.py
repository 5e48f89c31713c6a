"""AdmissionController: both caps, the K rule, granularity, hold, wait accounting."""

from __future__ import annotations

from prime_async.orchestrator.admission import AdmissionController


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(buffered: list[int], clock=None, **kw) -> AdmissionController:
    args = dict(
        max_inflight_groups=2,
        max_buffered_groups=3,
        max_off_policy_steps=1,
        group_size=2,
        granularity="group",
        buffered_groups=lambda: buffered[0],
    )
    args.update(kw)
    return AdmissionController(**args, clock=clock or FakeClock())


def test_inflight_cap_group_granularity():
    buffered = [0]
    adm = make(buffered)
    assert adm.poll() is None
    adm.on_group_dispatched()
    adm.on_group_dispatched()
    assert adm.poll() == "inflight_limit"
    adm.on_episodes_finished(2)  # a whole group's episodes finished, but the group has not returned
    assert adm.poll() == "inflight_limit"
    adm.on_group_returned()
    assert adm.poll() is None


def test_inflight_cap_sample_granularity_frees_per_episode():
    adm = make([0], granularity="sample")
    adm.on_group_dispatched()
    adm.on_group_dispatched()
    assert adm.poll() == "inflight_limit"
    adm.on_episodes_finished(1)  # one episode of group A and one of group B: group_size samples free
    adm.on_episodes_finished(1)
    assert adm.poll() is None


def test_buffer_cap_counts_inflight_plus_buffered():
    buffered = [0]
    adm = make(buffered, max_inflight_groups=10)
    adm.on_group_dispatched()
    buffered[0] = 2
    assert adm.poll() == "buffer_full"
    buffered[0] = 1
    assert adm.poll() is None


def test_k_rule_and_can_ship():
    adm = make([0], max_off_policy_steps=1)
    adm.on_batch_cut(0)  # next batch is 1, served 0: 1 - 0 <= 1
    assert adm.poll() is None
    adm.on_batch_cut(1)  # next batch is 2: a group stamped 0 could never ship
    assert adm.poll() == "off_policy"
    assert not adm.can_ship(0) and adm.can_ship(1)
    adm.set_served_version(1)
    assert adm.poll() is None


def test_hold_blocks_until_released():
    adm = make([0])
    adm.hold()
    assert adm.poll() == "hold"
    adm.release()
    assert adm.poll() is None


def test_wait_fractions_of_the_step_window():
    clock = FakeClock()
    buffered = [0]
    adm = make(buffered, clock=clock, max_inflight_groups=1, max_buffered_groups=5)
    adm.on_group_dispatched()
    assert adm.poll() == "inflight_limit"  # blocked from t=0
    clock.now = 3.0
    buffered[0] = 5
    assert adm.poll() == "buffer_full"  # 3 s in-flight limit, then buffer full from t=3
    clock.now = 4.0
    m = adm.window_metrics()
    assert m["rollout/buffer/admission_wait_inflight_limit"] == 0.75
    assert m["rollout/buffer/admission_wait_buffer_full"] == 0.25
    clock.now = 8.0  # still blocked by the buffer for the whole next window
    m = adm.window_metrics()
    assert m["rollout/buffer/admission_wait_buffer_full"] == 1.0
    assert m["rollout/buffer/admission_wait_inflight_limit"] == 0.0


def test_changed_event_is_set_on_every_capacity_change():
    adm = make([0])
    for change in (
        lambda: adm.on_episodes_finished(0),
        lambda: adm.on_batch_cut(3),
        lambda: adm.set_served_version(2),
        adm.notify,
    ):
        adm.changed.clear()
        change()
        assert adm.changed.is_set()
