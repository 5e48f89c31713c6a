"""Episodes with images into train batches and over the wire (issue 40): each sample's images travel in
its row at their row offsets, a shared prefix never splits an image nor shares different images, and the
wire carries the images byte for byte."""

from __future__ import annotations

import base64

import pytest

from prime_async.config.orchestrator import AdvantageConfig
from prime_async.orchestrator.batching import build_train_batch, shared_prefix_length
from prime_async.orchestrator.carry import decode_episode, encode_episode
from prime_async.orchestrator.types import Group
from prime_async.rollouts.types import Episode, EpisodeImage
from prime_async.transport.wire import WireError, decode_rank_slice, encode_rank_slice

PAD = 99


def _url(payload: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(payload).decode()


def image_episode(first: bytes, second: bytes, reward: float) -> Episode:
    """system(2) img1(4) q(2) reply(3) user(1) img2(4) q(1) reply(3): images at 2 and 12."""
    ids = [1, 2, *[PAD] * 4, 3, 4, 10, 11, 12, 5, *[PAD] * 4, 6, 13, 14, 15]
    loss = [False] * 8 + [True] * 3 + [False] * 6 + [True] * 3
    images = [
        EpisodeImage(_url(first), 2, 4, (1, 4, 4), 0),
        EpisodeImage(_url(second), 12, 4, (1, 4, 4), 1),
    ]
    return Episode(
        example_id=0, token_ids=ids, loss_mask=loss, sampler_logprobs=[-0.5 if m else 0.0 for m in loss],
        token_versions=[0 if m else -1 for m in loss], reward=reward, images=images,
    )  # fmt: skip


def _batch(episodes: list[Episode], share: bool):
    group = Group(group_id=0, example_id=0, dispatch_version=0, episodes=episodes)
    return build_train_batch(
        [group], step=1, seq_len=128, num_ranks=1, temperature=1.0, advantage_cfg=AdvantageConfig(),
        share_prefix=share,
    )  # fmt: skip


@pytest.mark.parametrize("share", [False, True])
def test_each_sample_keeps_its_images_in_its_row(share: bool) -> None:
    a, b = image_episode(b"img-A", b"img-B", 1.0), image_episode(b"img-A", b"img-C", 0.0)
    batch = _batch([a, b], share)
    (mb,) = batch.micro_batches[0]
    datas = [im.data for im in mb.images]
    # the shared prompt image is sent once when shared, the second turns' images always per sample
    want = [b"img-A", b"img-B", b"img-C"] if share else [b"img-A", b"img-B", b"img-A", b"img-C"]
    assert sorted(datas) == sorted(want)
    for im in mb.images:
        assert list(mb.input_ids[im.offset : im.offset + im.length]) == [PAD] * 4
        assert not mb.loss_mask[im.offset : im.offset + im.length].any()
    assert int((mb.input_ids == PAD).sum()) == 4 * len(mb.images)  # every pad token belongs to one image
    offsets = [im.offset for im in mb.images]
    assert offsets == sorted(offsets)


def test_shared_prefix_stops_before_an_image_that_differs() -> None:
    same = [image_episode(b"A", b"B", 1.0), image_episode(b"A", b"C", 0.0)]
    assert shared_prefix_length(same) == 7  # through the first image; the branch starts before its reply
    other = [image_episode(b"A", b"B", 1.0), image_episode(b"Z", b"B", 0.0)]
    assert shared_prefix_length(other) == 2  # the first images differ: shared only up to them


def test_the_wire_carries_the_images() -> None:
    batch = _batch([image_episode(b"A" * 50, b"B" * 7, 1.0), image_episode(b"A" * 50, b"C", 0.0)], True)
    frames = [bytes(f) for f in encode_rank_slice(batch, 0)]
    _, (mb,) = decode_rank_slice(frames, max_frame_bytes=1 << 20)
    assert mb.images == batch.micro_batches[0][0].images
    with pytest.raises(WireError):
        decode_rank_slice(frames[:-1], max_frame_bytes=1 << 20)


def test_carry_keeps_an_episodes_images() -> None:
    ep = image_episode(b"A", b"B", 1.0)
    assert decode_episode(encode_episode(ep)).images == ep.images
