"""The images of an episode's trained branch: where each sits in its token ids and which turn showed it.

Called by `rollouts/episode.py` for every trace with a branch. Pure: reads the gateway's recorded calls
(`GatewayCall.images`, `rollouts/images.py`).

Invariants: a prompt holds every image of the earlier turns (a multi-turn chat extends its history), so
the branch's images are those of the longest call whose prompt is a prefix of the branch; an image's
`turn` is the index, among the branch's calls in prompt order, of the first call whose prompt held it;
an image whose placeholder range would pass the branch's end (a cut at `seq_len`) is left out.
"""

from __future__ import annotations

from prime_async.rollouts.gateway import GatewayCall
from prime_async.rollouts.types import EpisodeImage


def _prefix_calls(token_ids: list[int], calls: list[GatewayCall]) -> list[GatewayCall]:
    """The calls whose prompt is a prefix of `token_ids`, shortest prompt first."""
    out = [c for c in calls if token_ids[: len(c.prompt_ids)] == c.prompt_ids]
    return sorted(out, key=lambda c: len(c.prompt_ids))


def branch_images(token_ids: list[int], calls: list[GatewayCall], limit: int) -> list[EpisodeImage]:
    """The images of a branch `token_ids` (cut to `limit` tokens), from its model calls' records."""
    with_images = [c for c in _prefix_calls(token_ids, calls) if c.images is not None]
    if not with_images:
        return []
    last = with_images[-1].images
    assert last is not None
    shown = [len(c.images.images.urls) if c.images is not None else 0 for c in with_images]
    out = []
    for i, (url, (offset, length), grid) in enumerate(
        zip(last.images.urls, last.images.spans, last.images.grid_thw, strict=True)
    ):
        if offset + length > min(limit, len(token_ids)):
            break
        turn = next(k for k, n in enumerate(shown) if n > i)
        out.append(EpisodeImage(url=url, offset=offset, length=length, grid_thw=grid, turn=turn))
    return out
