"""Wire format: round trip and every validation path raises WireError."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from prime_async.testing.synthetic import make_batch
from prime_async.transport.wire import (
    ARRAY_NAMES,
    BatchHeader,
    Request,
    WireError,
    decode_message,
    decode_rank_slice,
    encode_message,
    encode_rank_slice,
)

LAYOUT = [[[5, 7], [9]], [[4, 4, 4]]]


def _frames(rank: int = 0) -> list[bytes]:
    return [bytes(f) for f in encode_rank_slice(make_batch(3, LAYOUT), rank)]


def test_round_trip_every_rank() -> None:
    batch = make_batch(3, LAYOUT)
    for rank in range(2):
        header, mbs = decode_rank_slice(_frames(rank), max_frame_bytes=1 << 20)
        assert (header.step, header.rank, header.world_size) == (3, rank, 2)
        assert header.layout == [[12, 9], [12]]
        assert header.num_loss_tokens == batch.num_loss_tokens
        assert header.metrics == {"reward/mean": 0.5}
        assert len(mbs) == len(batch.micro_batches[rank])
        for got, want in zip(mbs, batch.micro_batches[rank], strict=True):
            for name in ARRAY_NAMES:
                np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
                assert getattr(got, name).dtype == getattr(want, name).dtype


def test_routed_experts_round_trip_and_padding_rows_unknown() -> None:
    """MoE routing replay: (T, layers * k) int16 per micro-batch; a row without routes (padding) arrives
    as all -1 (unknown); a batch with mixed widths is refused."""
    batch = make_batch(3, LAYOUT)
    rng = np.random.default_rng(0)
    for mbs in batch.micro_batches:
        for mb in mbs[:1]:
            mb.routed_experts = rng.integers(0, 4, (mb.num_tokens, 6)).astype(np.int16)
    for rank in range(2):
        header, mbs = decode_rank_slice(_frames_of(batch, rank), max_frame_bytes=1 << 20)
        assert header.routes_width == 6
        for got, want in zip(mbs, batch.micro_batches[rank], strict=True):
            expected = want.routes_or_unknown(6)
            np.testing.assert_array_equal(got.routed_experts, expected)
    assert (decode_rank_slice(_frames_of(batch, 0), max_frame_bytes=1 << 20)[1][1].routed_experts == -1).all()
    batch.micro_batches[0][1].routed_experts = np.zeros((batch.micro_batches[0][1].num_tokens, 4), np.int16)
    with pytest.raises(WireError, match="different widths"):
        encode_rank_slice(batch, 0)
    assert decode_rank_slice(_frames(0), max_frame_bytes=1 << 20)[1][0].routed_experts is None


def _frames_of(batch, rank: int) -> list[bytes]:
    return [bytes(f) for f in encode_rank_slice(batch, rank)]


def test_request_round_trip() -> None:
    assert decode_message(encode_message(Request(step=4, rank=1, world_size=2))) == Request(4, 1, 2)


def test_unknown_message_type() -> None:
    with pytest.raises(WireError, match="unknown message"):
        decode_message(msgspec.msgpack.encode({"type": "pickle", "step": 1}))
    with pytest.raises(WireError):
        decode_message(b"\x80\x04garbage")


def test_truncated_frame() -> None:
    frames = _frames()
    frames[1] = frames[1][:-4]
    with pytest.raises(WireError, match="bytes for"):
        decode_rank_slice(frames, max_frame_bytes=1 << 20)


def test_missing_frame() -> None:
    with pytest.raises(WireError, match="array frames"):
        decode_rank_slice(_frames()[:-1], max_frame_bytes=1 << 20)


def test_frame_too_large() -> None:
    with pytest.raises(WireError, match="max_frame_bytes"):
        decode_rank_slice(_frames(), max_frame_bytes=8)


def _patched_header(**changes) -> list[bytes]:
    frames = _frames()
    header = msgspec.msgpack.decode(frames[0], type=BatchHeader)
    frames[0] = msgspec.msgpack.encode(msgspec.structs.replace(header, **changes))
    return frames


def test_wrong_dtype() -> None:
    header = msgspec.msgpack.decode(_frames()[0], type=BatchHeader)
    arrays = list(header.arrays)
    arrays[0] = msgspec.structs.replace(arrays[0], dtype="<i8")
    with pytest.raises(WireError, match="dtype"):
        decode_rank_slice(_patched_header(arrays=arrays), max_frame_bytes=1 << 20)


def test_layout_mismatch_and_bad_fields() -> None:
    with pytest.raises(WireError, match="layout"):
        decode_rank_slice(_patched_header(layout=[[13, 9], [12]]), max_frame_bytes=1 << 20)
    with pytest.raises(WireError, match="temperature"):
        decode_rank_slice(_patched_header(temperature=float("nan")), max_frame_bytes=1 << 20)
    with pytest.raises(WireError, match="loss tokens"):
        decode_rank_slice(_patched_header(num_loss_tokens=1), max_frame_bytes=1 << 20)
    with pytest.raises(WireError, match="protocol"):
        decode_rank_slice(_patched_header(protocol=99), max_frame_bytes=1 << 20)
