"""Batch stream over real ZeroMQ sockets: handshake, slices per rank, restarts, errors."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import zmq

from prime_async.testing.synthetic import make_batch, transport_cfg
from prime_async.transport import zmq_batches
from prime_async.transport.wire import WireError, encode_rank_slice
from prime_async.transport.zmq_batches import BatchReceiver, BatchSender

LAYOUT = [[[5, 7], [9]], [[4, 4, 4]]]


def test_send_waits_for_slow_joiner_and_slices_per_rank() -> None:
    cfg = transport_cfg()
    with BatchSender(cfg=cfg, num_ranks=2) as sender:
        r0 = BatchReceiver(cfg=cfg, rank=0, world_size=2)
        got: dict[int, object] = {}
        t0 = threading.Thread(target=lambda: got.__setitem__(0, r0.receive(0)))
        t0.start()
        with pytest.raises(TimeoutError, match=r"\[1\]"):
            sender.wait_ready(timeout=0.3)  # rank 1 has not joined yet
        sent = threading.Thread(target=lambda: sender.send(make_batch(0, LAYOUT)))
        sent.start()
        r1 = BatchReceiver(cfg=cfg, rank=1, world_size=2)  # joins late, loses nothing
        got[1] = r1.receive(0)
        sent.join(10)
        t0.join(10)
        want = make_batch(0, LAYOUT)
        for rank in range(2):
            assert got[rank].step == 0 and got[rank].rank == rank
            assert got[rank].layout == [[12, 9], [12]] and got[rank].max_micro_batches == 2
            for mb, ref in zip(got[rank].micro_batches, want.micro_batches[rank], strict=True):
                np.testing.assert_array_equal(mb.input_ids, ref.input_ids)
        r0.close()
        r1.close()


def test_steps_in_order_and_restart_resend() -> None:
    cfg = transport_cfg()
    with BatchSender(cfg=cfg, num_ranks=1, resend_window=3) as sender:
        rx = BatchReceiver(cfg=cfg, rank=0, world_size=1)
        threading.Thread(target=lambda: [sender.send(make_batch(s, [[[6]]])) for s in range(5)]).start()
        for s in range(5):
            assert rx.receive(s).step == s
        rx.close()
        # a restarted trainer (fresh identity) resumes at step 2: still cached (window 3)
        rx2 = BatchReceiver(cfg=cfg, rank=0, world_size=1)
        b = rx2.receive(2)
        want = make_batch(2, [[[6]]]).micro_batches[0][0]
        np.testing.assert_array_equal(b.micro_batches[0].input_ids, want.input_ids)
        with pytest.raises(RuntimeError, match="no longer cached"):
            rx2.receive(0)
        rx2.close()


def test_future_step_waits_until_sent() -> None:
    cfg = transport_cfg()
    with BatchSender(cfg=cfg, num_ranks=1) as sender:
        rx = BatchReceiver(cfg=cfg, rank=0, world_size=1)
        sender_thread = threading.Thread(target=lambda: sender.send(make_batch(0, [[[6]]])))
        sender_thread.start()
        assert rx.receive(0).step == 0
        with pytest.raises(TimeoutError, match="step 1"):
            rx.receive(1, timeout=0.3)
        sender.send(make_batch(1, [[[6]]]))
        # the earlier request for step 1 is answered now; the receiver must not see it as a wrong step
        rx2 = BatchReceiver(cfg=cfg, rank=0, world_size=1)
        assert rx2.receive(1).step == 1
        rx.close()
        rx2.close()


def test_wrong_world_size_is_refused() -> None:
    cfg = transport_cfg()
    with BatchSender(cfg=cfg, num_ranks=2):
        rx = BatchReceiver(cfg=cfg, rank=0, world_size=3)
        with pytest.raises(RuntimeError, match="world"):
            rx.receive(0)
        rx.close()


def test_wrong_step_from_peer_is_an_error() -> None:
    """A (buggy) sender answering step 1 to a request for step 0 is a WireError, not a skip."""
    from prime_async.transport.wire import encode_rank_slice

    cfg = transport_cfg()
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(f"tcp://{cfg.host}:{cfg.port}")
    rx = BatchReceiver(cfg=cfg, rank=0, world_size=1)

    def serve() -> None:
        identity, _ = router.recv_multipart()
        router.send_multipart([identity, *encode_rank_slice(make_batch(1, [[[6]]]), 0)])

    t = threading.Thread(target=serve)
    t.start()
    with pytest.raises(WireError, match="asked for step 0"):
        rx.receive(0)
    t.join(5)
    rx.close()
    router.close(linger=0)


def test_batch_with_wrong_rank_count_rejected() -> None:
    cfg = transport_cfg()
    with BatchSender(cfg=cfg, num_ranks=2) as sender, pytest.raises(ValueError, match="rank slices"):
        sender.send(make_batch(0, [[[6]]]))


def test_wait_delivered_keeps_the_last_batch_alive_for_a_late_trainer() -> None:
    cfg = transport_cfg()
    with BatchSender(cfg=cfg, num_ranks=1) as sender:
        rx = BatchReceiver(cfg=cfg, rank=0, world_size=1)
        got: dict[str, object] = {}
        reader = threading.Thread(target=lambda: got.__setitem__("b", rx.receive(0)))
        reader.start()
        sender.send(make_batch(0, [[[6]]]))
        assert sender.wait_delivered(0, timeout=10)
        reader.join(10)
        assert got["b"].step == 0
        assert not sender.wait_delivered(1, timeout=0.2)  # batch 1 was never asked for
        rx.close()


def test_stop_serving_answers_nothing_newer_than_the_step_it_returns() -> None:
    """A planned stop: the step returned is what the trainer can have; newer cached batches are never
    answered by this sender, older ones still are (a rank that lost its answer asks again)."""
    cfg = transport_cfg()
    with BatchSender(cfg=cfg, num_ranks=1) as sender:
        rx = BatchReceiver(cfg=cfg, rank=0, world_size=1)
        sending = threading.Thread(target=lambda: [sender.send(make_batch(s, [[[6]]])) for s in range(3)])
        sending.start()
        assert rx.receive(0).step == 0 and rx.receive(1).step == 1
        assert sender.stop_serving() == 1 and sender.stop_serving() == 1  # idempotent
        sending.join(10)
        assert sender.last_step == 2  # batch 2 is cached ...
        with pytest.raises(TimeoutError, match="step 2"):
            rx.receive(2, timeout=0.5)  # ... and never served by the frozen sender
        assert sender.delivered_step() == 1
        rx2 = BatchReceiver(cfg=cfg, rank=0, world_size=1)
        assert rx2.receive(1).step == 1  # the fetched step still is
        rx.close()
        rx2.close()


def test_stop_serving_before_any_fetch_returns_none() -> None:
    cfg = transport_cfg()
    with BatchSender(cfg=cfg, num_ranks=1) as sender:
        assert sender.stop_serving() is None


def test_an_answer_to_the_socket_the_receiver_just_replaced_still_arrives(monkeypatch) -> None:
    """The sender answers the request of the receiver's previous socket just after the receiver asked
    again from a fresh one (the sender counts that answer as fetched): the receiver must get it."""
    monkeypatch.setattr(zmq_batches, "ASK_AGAIN_S", 0.2)
    cfg = transport_cfg()
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind(f"tcp://{cfg.host}:{cfg.port}")
    rx = BatchReceiver(cfg=cfg, rank=0, world_size=1)
    got: dict[str, object] = {}
    reader = threading.Thread(target=lambda: got.__setitem__("b", rx.receive(0, timeout=5)), daemon=True)
    try:
        reader.start()
        assert router.poll(5000)
        first = router.recv_multipart()[0]
        assert router.poll(5000)  # the receiver asked again, from a fresh socket
        assert router.recv_multipart()[0] != first
        router.send_multipart([first, *encode_rank_slice(make_batch(0, [[[6]]]), 0)], copy=False)
        reader.join(10)
        assert "b" in got and got["b"].step == 0
    finally:
        rx.close()
        router.close(linger=0)


def test_a_port_taken_by_another_socket_is_refused_after_the_bind_retry(monkeypatch) -> None:
    """A second sender on a live sender's port waits BIND_RETRY_S for it, then gets the one-line refusal;
    once the first is closed, the same port binds at once (a resumed lifetime in the same process)."""
    import time

    monkeypatch.setattr(zmq_batches, "BIND_RETRY_S", 0.3)
    cfg = transport_cfg()
    first = BatchSender(cfg=cfg, num_ranks=1)
    try:
        start = time.monotonic()
        with pytest.raises(
            ValueError, match=rf"transport.port = {cfg.port} on 127.0.0.1: .*choose another port"
        ):
            BatchSender(cfg=cfg, num_ranks=1)
        assert 0.3 <= time.monotonic() - start < 5
    finally:
        first.close()
    for _ in range(5):  # close then bind again at once, as a planned stop's next lifetime does
        BatchSender(cfg=cfg, num_ranks=1).close()
