"""In-flight work carried across an orchestrator restart: saved with each checkpoint, reused on resume.

    checkpoint / planned stop:  pending groups (unsent batches, buffered, in flight)
        ──snapshot──► [CarriedGroup: dispatch version, finished episodes, unfinished episodes' calls]
        ──encode──► the checkpoint's "carry" list (JSON)
    resume:  Carry(checkpoint["carry"], served_version)
        dispatcher draws (env, example, epoch) ──take──► CarriedGroup or None
            finished episode   -> reused as it is (no env run, its span and reward kept)
            unfinished episode -> run again with `replay` = its calls (`rollouts/replay.py`)

Invariants:
- a carried group is dispatched with its original `dispatch_version`, so the sink's sweep and the cut's
  cancel apply the staleness bound K to its true age (a group past K is dropped and counted in the
  ledger like any stale group); no token is reused whose version is newer than the version the engines
  serve at resume (after a rollback those belong to an abandoned history: cut off and counted as
  discarded);
- the carry of a checkpoint holds exactly the groups its data position lists as pending (issued, not
  trained), so each carried group is matched by the prompt the data source reissues first: nothing is
  trained twice and nothing is carried for a prompt that is not reissued;
- deterministic runs carry nothing: their episodes regenerate the same tokens from their seeds;
- a checkpoint taken in a resumed lifetime carries, besides its pending groups, the carried groups not
  taken yet (`Carry.untaken`): their prompts are still queued as retries, so their work is kept too.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

from prime_async.orchestrator.types import CarriedGroup, Group
from prime_async.rollouts.gateway import GatewayCall
from prime_async.rollouts.images import ImagePrompt, PromptImages
from prime_async.rollouts.types import Episode, EpisodeImage, PolicySpan

logger = logging.getLogger(__name__)

Recorded = Callable[[Group, int], list[GatewayCall]]
_EPISODE_LISTS = ("token_ids", "loss_mask", "sampler_logprobs", "token_versions", "teacher_logprobs")


def encode_call(call: GatewayCall) -> dict[str, Any]:
    experts = None if call.routed_experts is None else [int(x) for x in call.routed_experts]
    return {
        "prompt_ids": call.prompt_ids, "output_ids": call.output_ids, "output_logprobs": call.output_logprobs,
        "token_versions": call.token_versions, "finish_type": call.finish_type,
        "weight_version": call.weight_version, "routed_experts": experts,
        "images": None if call.images is None else _encode_prompt_images(call.images),
    }  # fmt: skip


def _encode_prompt_images(images: ImagePrompt) -> dict[str, Any]:
    placed = images.images
    return {
        "engine_ids": images.engine_ids,
        "urls": placed.urls,
        "spans": placed.spans,
        "grids": placed.grid_thw,
    }


def _decode_prompt_images(d: dict[str, Any] | None) -> ImagePrompt | None:
    if d is None:
        return None
    placed = PromptImages(
        urls=list(d["urls"]), spans=[(int(o), int(n)) for o, n in d["spans"]],
        grid_thw=[(int(t), int(h), int(w)) for t, h, w in d["grids"]],
    )  # fmt: skip
    return ImagePrompt(engine_ids=list(d["engine_ids"]), images=placed)


def decode_call(d: dict[str, Any]) -> GatewayCall:
    experts = d.get("routed_experts")
    if experts is not None:
        import numpy as np

        experts = np.asarray(experts, dtype=np.int32)
    return GatewayCall(
        prompt_ids=list(d["prompt_ids"]), output_ids=list(d["output_ids"]),
        output_logprobs=list(d["output_logprobs"]), token_versions=list(d["token_versions"]),
        finish_type=d["finish_type"], weight_version=int(d["weight_version"]), routed_experts=experts,
        images=_decode_prompt_images(d.get("images")),
    )  # fmt: skip


def _json_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in metrics.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        out[key] = value
    return out


def encode_episode(ep: Episode) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(ep, name) for name in _EPISODE_LISTS}
    out.update(
        example_id=ep.example_id, reward=ep.reward, status=ep.status, error=ep.error, truncated=ep.truncated,
        overlong=ep.overlong, seat=ep.seat, metrics=_json_metrics(ep.metrics),
        span=None if ep.span is None else [ep.span.start, ep.span.end],
        routed_experts=None if ep.routed_experts is None else ep.routed_experts.tolist(),
        images=[[im.url, im.offset, im.length, list(im.grid_thw), im.turn] for im in ep.images],
    )  # fmt: skip
    return out


def decode_episode(d: dict[str, Any]) -> Episode:
    routed = d.get("routed_experts")
    if routed is not None:
        import numpy as np

        routed = np.asarray(routed, dtype=np.int16)
    span = d.get("span")
    return Episode(
        example_id=int(d["example_id"]), token_ids=d["token_ids"], loss_mask=d["loss_mask"],
        sampler_logprobs=d["sampler_logprobs"], token_versions=d["token_versions"], routed_experts=routed,
        teacher_logprobs=d.get("teacher_logprobs"), reward=d.get("reward"),
        span=None if span is None else PolicySpan(int(span[0]), int(span[1])), status=d["status"],
        error=d.get("error"), truncated=bool(d["truncated"]), overlong=bool(d["overlong"]),
        metrics=dict(d.get("metrics") or {}), seat=d.get("seat", "agent"),
        images=[EpisodeImage(u, int(o), int(n), (int(g[0]), int(g[1]), int(g[2])), int(t))
                for u, o, n, g, t in d.get("images") or []],
    )  # fmt: skip


def snapshot(groups: Iterable[Group], group_size: int, recorded: Recorded) -> list[dict[str, Any]]:
    """The carry of `groups` (pending, oldest first): per group its finished episodes and the calls each
    unfinished episode has recorded so far (`recorded(group, index)`). No await: a consistent cut."""
    out = []
    for group in groups:
        done = {str(i): [encode_episode(ep) for ep in eps] for i, eps in group.finished_by_index.items()}
        calls = {
            str(i): [encode_call(c) for c in cs]
            for i in range(group_size)
            if i not in group.finished_by_index and (cs := recorded(group, i))
        }
        out.append({
            "env": group.env, "example_id": group.example_id, "epoch": group.epoch,
            "dispatch_version": group.dispatch_version, "done": done, "calls": calls,
        })  # fmt: skip
    return out


def encode_carried(group: CarriedGroup) -> dict[str, Any]:
    """A carried group in the form `snapshot` gives a pending group (a later checkpoint saves it again)."""
    return {
        "env": group.env, "example_id": group.example_id, "epoch": group.epoch,
        "dispatch_version": group.dispatch_version,
        "done": {str(i): [encode_episode(ep) for ep in eps] for i, eps in group.done.items()},
        "calls": {str(i): [encode_call(c) for c in cs] for i, cs in group.calls.items()},
    }  # fmt: skip


def _cut_calls(calls: list[GatewayCall], limit: int) -> tuple[list[GatewayCall], int]:
    """The calls' prefix sampled under versions <= `limit` (the call crossing it kept as a partial one),
    and the number of sampled tokens cut off."""
    kept: list[GatewayCall] = []
    for i, call in enumerate(calls):
        newer = [j for j, v in enumerate(call.token_versions) if v > limit]
        if not newer:
            kept.append(call)
            continue
        n = newer[0]
        if n:
            kept.append(GatewayCall(
                prompt_ids=call.prompt_ids, output_ids=call.output_ids[:n],
                output_logprobs=call.output_logprobs[:n], token_versions=call.token_versions[:n],
                finish_type="abort", weight_version=call.weight_version, routed_experts=None,
            ))  # fmt: skip
        dropped = len(call.output_ids) - n + sum(len(c.output_ids) for c in calls[i + 1 :])
        return kept, dropped
    return kept, 0


def _carried_group(d: dict[str, Any], limit: int) -> tuple[CarriedGroup, int]:
    """One decoded carried group with its work after `limit` cut off, and the tokens cut off."""
    group = CarriedGroup(
        env=str(d["env"]), example_id=int(d["example_id"]), epoch=int(d["epoch"]),
        dispatch_version=int(d["dispatch_version"]),
    )  # fmt: skip
    dropped = 0
    for index, eps in d["done"].items():
        episodes = [decode_episode(e) for e in eps]
        if all(v <= limit for ep in episodes for v in ep.token_versions):
            group.done[int(index)] = episodes
        else:
            dropped += sum(ep.num_completion_tokens for ep in episodes)
    for index, cs in d["calls"].items():
        calls, cut = _cut_calls([decode_call(c) for c in cs], limit)
        dropped += cut
        if calls:
            group.calls[int(index)] = calls
    return group, dropped


class Carry:
    """The carried groups of a resumed run, handed out once each by prompt (`take`)."""

    def __init__(self, state: list[dict[str, Any]], *, served_version: int):
        self._groups: dict[tuple[str, int, int], list[CarriedGroup]] = {}
        self.discarded_tokens = 0
        self.carried_tokens = 0
        self.reused_finished_tokens = 0
        self.num_groups = 0
        for d in state:
            group, dropped = _carried_group(d, served_version)
            self.discarded_tokens += dropped
            if group.dispatch_version > served_version:
                continue  # all its work was newer: nothing to carry, the prompt is simply reissued
            self.carried_tokens += group.sampled_tokens()
            self.num_groups += 1
            self._groups.setdefault((group.env, group.example_id, group.epoch), []).append(group)
        logger.info(
            "resume: %d groups carried over with %d sampled tokens (%d tokens newer than v%d discarded)",
            self.num_groups, self.carried_tokens, self.discarded_tokens, served_version,
        )  # fmt: skip

    def take(self, env: str, example_id: int, epoch: int) -> CarriedGroup | None:
        """The carried work of this prompt (once), or None."""
        queue = self._groups.get((env, example_id, epoch))
        if not queue:
            return None
        group = queue.pop(0)
        if not queue:
            del self._groups[(env, example_id, epoch)]
        return group

    def untaken(self) -> list[dict[str, Any]]:
        """The carried groups no prompt has taken yet, encoded for a checkpoint: their prompts are still
        in the data source's retry queue (issued, not trained), so a checkpoint taken now must carry
        their work again, or a second restart would lose it (the prompts alone would be regenerated)."""
        return [encode_carried(group) for queue in self._groups.values() for group in queue]

    def count_reused(self, trajectories: list[Episode]) -> None:
        self.reused_finished_tokens += sum(ep.num_completion_tokens for ep in trajectories)

    def metrics(self) -> dict[str, float]:
        return {
            "resume/carried_groups": float(self.num_groups),
            "resume/carried_tokens": float(self.carried_tokens),
            "resume/discarded_tokens": float(self.discarded_tokens),
            "resume/reused_finished_tokens": float(self.reused_finished_tokens),
            "resume/pending_groups": float(sum(len(q) for q in self._groups.values())),
        }
