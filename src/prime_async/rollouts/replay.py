"""Replay of an episode's recorded engine calls after an orchestrator restart (in-flight work carried over).

    earlier lifetime: Gateway records every call of an episode (`GatewayCall`: prompt ids, sampled ids,
        sampler logprobs, per-token versions); a planned stop aborts the calls still running, so their
        partial output is recorded too (finish "abort")
    this lifetime:  the episode runs again from its start with `replay = those calls`; for each request
        the gateway looks for a recorded call with the *same prompt token ids*:
          finished call  -> answered from the record, no engine call (the env sees the same reply)
          partial call   -> the engine continues it: prompt + the kept tokens are re-prefilled under the
                            weights served now, sampling goes on for the remaining budget (as `retract`
                            does within one lifetime); the answer is kept tokens + new ones, each token
                            with the logprob and version it was sampled with
          no such call   -> a normal engine call (the env diverged: the rest is generated afresh)

Why matching by prompt ids: it needs nothing from the environment but determinism given the same model
replies (single-turn envs, the chat harness, tool envs with deterministic tools); an env that is not
deterministic simply stops matching at its first differing turn and regenerates from there, which the
`replay_misses` counter and a log line say. Nothing is ever answered from a record whose prompt differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prime_async.engine_api import GenerateResult


@dataclass
class ReplayStats:
    """Tokens a gateway reused from an earlier lifetime, and requests that found no record."""

    replayed_tokens: int = 0  # sampled tokens of finished calls answered from the record
    continued_tokens: int = 0  # kept tokens of partial calls the engine continued
    replayed_calls: int = 0
    continued_calls: int = 0
    misses: int = 0  # requests of a replaying session with no recorded call of that prompt

    def count_replayed(self, tokens: int) -> None:
        self.replayed_calls += 1
        self.replayed_tokens += tokens

    def count_continued(self, kept_tokens: int) -> None:
        self.continued_calls += 1
        self.continued_tokens += kept_tokens

    def metrics(self) -> dict[str, float]:
        return {
            "resume/replayed_tokens": float(self.replayed_tokens),
            "resume/continued_tokens": float(self.continued_tokens),
            "resume/replayed_calls": float(self.replayed_calls),
            "resume/continued_calls": float(self.continued_calls),
            "resume/replay_misses": float(self.misses),
        }


def take_recorded(replay: list[Any], prompt_ids: Sequence[int]) -> Any | None:
    """Remove and return the first recorded call of `replay` whose prompt is `prompt_ids` (None: none)."""
    for i, call in enumerate(replay):
        if call.prompt_ids == list(prompt_ids):
            return replay.pop(i)
    return None


def is_partial(call: Any) -> bool:
    """A call that was cut short (aborted at a planned stop): the engine has to continue it."""
    return call.finish_type not in ("stop", "length")


def recorded_result(call: Any, rid: str) -> GenerateResult:
    """The engine answer a finished recorded call stands for."""
    return GenerateResult(
        rid=rid, output_ids=list(call.output_ids), output_logprobs=list(call.output_logprobs),
        token_versions=list(call.token_versions), finish_type=call.finish_type,
        prompt_tokens=len(call.prompt_ids), weight_version=call.weight_version,
        routed_experts=call.routed_experts,
    )  # fmt: skip


def continued_result(partial: Any, more: GenerateResult) -> GenerateResult:
    """Kept tokens of `partial` followed by what the engine sampled after them (`more`, whose request
    had the kept tokens in its prompt)."""
    versions = more.token_versions or [more.weight_version] * len(more.output_ids)
    return GenerateResult(
        rid=more.rid, output_ids=[*partial.output_ids, *more.output_ids],
        output_logprobs=[*partial.output_logprobs, *more.output_logprobs],
        token_versions=[*partial.token_versions, *versions], finish_type=more.finish_type,
        prompt_tokens=len(partial.prompt_ids), weight_version=more.weight_version,
        routed_experts=more.routed_experts,  # the continued request covers the kept tokens' positions too
    )  # fmt: skip
