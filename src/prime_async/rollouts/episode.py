"""Turn one finished verifiers episode (+ the gateway's record of its model calls) into trained
trajectories: one `Episode` per trainable trace (`build_episodes`).

A single-agent env has one trace per episode, so one `Episode`. A multi-agent env (its `run(task,
agents)` drives several seats) has one trace per agent run: each trace whose `agent.trainable` is True
becomes one `Episode` with `seat = trace.agent.name` and its own reward (the trace's), tokens, masks,
logprobs and versions. Traces the env marked untrainable (e.g. a simulated user) are not trained. When
the verifiers episode failed, or yields no trainable trace, the result is one error `Episode`.

Called by `rollouts/verifiers_source.py` after every verifiers episode. Pure: no I/O, no verifiers import at
module level (it receives verifiers objects and reads their documented attributes).

Invariants of the returned `Episode`:
- `token_ids`, `loss_mask`, `sampler_logprobs`, `token_versions` have equal length, at most `seq_len`;
- `loss_mask` is True exactly on tokens the policy sampled (verifiers' `Branch.sampled_mask`): prompt,
  chat-template scaffold, user turns and tool results are False;
- `sampler_logprobs` is the engine's logprob on sampled tokens and 0.0 elsewhere; all finite;
- `token_versions` is the engine-reported weight version on sampled tokens and -1 elsewhere;
- `metrics["env/<metric>"]` is each `@vf.metric` value of the trace and `metrics["env/reward_fn/<name>"]`
  each reward function's score (unweighted), when computed (`env_values`);
- `images` are the images in the trained branch's tokens (`episode_images.py`), `metrics["images"]` their
  count when there are any;
- `metrics["sampled_tokens"]` is what the trace's seat sampled over all its turns and branches (at least
  the loss tokens of the trained branch, before any `seq_len` cut);
- `truncated` is True when the episode was cut: by `seq_len` (the gateway clamps every turn to it), by a
  turn's `max_tokens` (finish reason "length"), or by a verifiers rollout limit (`Trace.is_truncated`);
- `overlong` is True when a turn did not fit `seq_len` (`overflow_turn`: its prompt was refused as too
  long, and the env's harness ended the episode there, or its reply was clamped at `seq_len`), or the
  trained branch is longer than `seq_len`; then `metrics["overflow_turn"]` and
  `metrics["overflow_prompt_tokens"]` name the first such turn (from 1) and its prompt length when a
  model call shows it. The sink's `overlong` policy decides: trained up to there, or dropped;
- environment faults never raise: a failed rollout, a reward that raised or is None/NaN, or an episode
  in which the policy sampled no token give `status="error"` with `error` set and `metrics["env_error"]`
  naming the kind, first cause first (`prompt_too_long` when the first model call was refused because
  its prompt does not fit `seq_len`, `model_call` for another failed call, else `empty_completion`);
  an engine abort gives `status="aborted"`;
- an empty or whitespace final reply with sampled tokens (e.g. only the end-of-turn token) is a legal
  action of the policy, trained with its reward like any other: it is not an error;
- a seat of a multi-agent episode that made no model call (a game that ended before its turn, e.g. the
  other player forfeited) gives `status="idle"`: no token, `error` None, its reward when the env scored
  it (None otherwise). It is not an error and is never trained (the dispatcher removes it before the
  sink). A single-agent episode without a model call stays an error (`empty_completion`): there the
  environment never asked the policy anything.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

import numpy as np

from prime_async.rollouts.episode_errors import user_frame
from prime_async.rollouts.episode_images import branch_images
from prime_async.rollouts.gateway import GatewayCall, GatewaySession
from prime_async.rollouts.types import Episode

EnvErrorKind = Literal[
    "rollout", "reward", "prompt_too_long", "model_call", "empty_completion", "no_trace", "engine_abort",
]  # fmt: skip
# verifiers' renderers client refuses a prompt longer than the gateway's `max_model_len` (= seq_len)
# before any request is sent, with this message (renderers.OverlongPromptError)
_OVERLONG = re.compile(r"Prompt length \((\d+)\) exceeds maximum context length \((\d+)\)")


def describe_errors(errors: list[Any]) -> str:
    """verifiers' recorded errors as `type: message [at path:line in fn]; ...`: each with the innermost
    frame of the user's code that raised it when its traceback shows one (`episode_errors.user_frame`)."""
    parts = []
    for e in errors:
        where = user_frame(getattr(e, "traceback", None))
        parts.append(f"{e.type}: {e.message}" + (f" [at {where}]" if where else ""))
    return "; ".join(parts)


def _error(episode: Episode, kind: EnvErrorKind, message: str) -> Episode:
    episode.status = "aborted" if kind == "engine_abort" else "error"
    episode.error = f"{kind}: {message}"
    episode.metrics["env_error"] = kind
    return episode


def _sampled_versions(branch: Any, calls: list[GatewayCall]) -> tuple[list[int], int]:
    """Per-token versions of a branch: each sampled node is matched, in order, to the gateway call whose
    output starts with the node's sampled tokens. Returns (versions, number of unmatched nodes)."""
    versions: list[int] = []
    unmatched = 0
    next_call = 0
    for node in branch.nodes:
        sampled = [tok for tok, m in zip(node.token_ids, node.mask, strict=True) if m]
        node_versions = [-1] * len(node.token_ids)
        if sampled:
            match = None
            for j in range(next_call, len(calls)):
                if calls[j].output_ids[: len(sampled)] == sampled:
                    match = j
                    break
            if match is None:
                unmatched += 1
            else:
                next_call = match + 1
                src = iter(calls[match].token_versions)
                node_versions = [next(src) if m else -1 for m in node.mask]
        versions.extend(node_versions)
    return versions, unmatched


def branch_routes(token_ids: list[int], calls: list[GatewayCall]) -> np.ndarray | None:
    """The engine's routed experts of a branch's tokens: taken from the longest model call whose prompt
    + output is a prefix of the branch (its prefill ran through every earlier turn), -1 past what that
    call ran through (its last token at least). None when no call carries routes."""
    best, best_len = None, 0
    for call in calls:
        n = len(call.prompt_ids) + len(call.output_ids)
        if call.routed_experts is None or n <= best_len or n > len(token_ids):
            continue
        if token_ids[: len(call.prompt_ids)] == call.prompt_ids and token_ids[len(call.prompt_ids) : n] == (
            call.output_ids
        ):
            best, best_len = call, n
    if best is None:
        return None
    flat = np.asarray(best.routed_experts)
    for positions in (best_len - 1, best_len):  # SGLang leaves out the last token (it never ran)
        if positions > 0 and flat.size % positions == 0 and flat.size:
            width = flat.size // positions
            routes = np.full((len(token_ids), width), -1, dtype=np.int16)
            routes[:positions] = flat.reshape(positions, width)
            return routes
    return None


ENV_METRIC = "env/"  # Episode.metrics key prefix of the env's own `@vf.metric` values
ENV_REWARD = "env/reward_fn/"  # ... and of each reward function's score (unweighted)


def env_values(trace: Any) -> dict[str, float]:
    """The env's own values of a trace as `Episode.metrics` entries: every `@vf.metric` as
    `env/<metric>` and every reward function's score as `env/reward_fn/<reward>` (None or not finite: left
    out). `split_env_values` reads them back."""
    out = {f"{ENV_METRIC}{k}": float(v) for k, v in trace.metrics.items() if v is not None}
    rewards = getattr(trace, "rewards", None) or {}
    out.update({f"{ENV_REWARD}{k}": float(r.score) for k, r in rewards.items() if r is not None})
    return {k: v for k, v in out.items() if math.isfinite(v)}


def split_env_values(metrics: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """(metrics, rewards) of an episode's `env_values`, keyed by the env's own names."""
    found: tuple[dict[str, float], dict[str, float]] = ({}, {})
    for key, value in metrics.items():
        if key.startswith(ENV_REWARD):
            found[1][key.removeprefix(ENV_REWARD)] = value
        elif key.startswith(ENV_METRIC):
            found[0][key.removeprefix(ENV_METRIC)] = value
    return found


def _reward_fault(trace: Any) -> str | None:
    """Why the trace's reward cannot be trained on, or None."""
    if not trace.rewards:
        return "the task recorded no reward"
    for name, reward in trace.rewards.items():
        if reward is None:
            return f"reward {name!r} was not computed"
        if not math.isfinite(reward.value):
            return f"reward {name!r} is not finite ({reward.value})"
    return None


def build_episodes(
    *, example_id: int, vf_episode: Any, session: GatewaySession, seq_len: int
) -> list[Episode]:
    """The trained trajectories of one verifiers episode (see the module docstring and invariants)."""
    episode = Episode(example_id=example_id)
    episode.metrics["num_model_calls"] = len(session.calls)
    if session.aborted:
        return [_error(episode, "engine_abort", "the engine aborted a request of this episode")]
    traces = list(vf_episode.traces)
    if not traces:
        errors = describe_errors(vf_episode.errors) or "no trace"
        return [_error(episode, "no_trace", errors[:2000])]
    trained = [t for t in traces if t.agent.trainable]
    if not trained:
        return [_error(episode, "no_trace", "the episode has no trainable trace (every seat untrainable)")]
    if len(traces) == 1:
        return [_trace_episode(episode, traces[0], vf_episode, session, seq_len)]
    out = []
    for trace in trained:
        ep = Episode(example_id=example_id, seat=trace.agent.name)
        ep.metrics["num_model_calls"] = len(session.calls)
        if _without_turn(trace) and vf_episode.ok and trace.ok:
            out.append(_idle(ep, trace))
        else:
            out.append(_trace_episode(ep, trace, vf_episode, session, seq_len))
    return out


def _without_turn(trace: Any) -> bool:
    """Whether the seat of `trace` never acted: no model call (failed ones included), no sampled token."""
    return not trace.calls and not any(m for branch in trace.branches for m in branch.sampled_mask)


def _idle(episode: Episode, trace: Any) -> Episode:
    """The trajectory of a seat that never acted: no token, not an error, never trained."""
    episode.status = "idle"
    episode.seat = trace.agent.name
    episode.metrics["num_turns"] = trace.num_turns
    episode.metrics.update(env_values(trace))
    episode.reward = None if _reward_fault(trace) else float(trace.reward)
    return episode


def _trace_episode(
    episode: Episode, trace: Any, vf_episode: Any, session: GatewaySession, seq_len: int
) -> Episode:
    """Fill `episode` from one trace (its last branch) and classify its faults."""
    episode.seat = trace.agent.name
    branches = trace.branches
    episode.metrics["num_turns"] = trace.num_turns
    episode.metrics["num_branches"] = len(branches)
    episode.metrics.update(env_values(trace))
    if branches:
        branch = branches[-1]
        episode.token_ids = list(branch.token_ids)
        episode.loss_mask = list(branch.sampled_mask)
        episode.sampler_logprobs = [float(x) for x in branch.logprobs]
        episode.token_versions, unmatched = _sampled_versions(branch, session.calls)
        episode.metrics["unmatched_version_nodes"] = unmatched
        episode.routed_experts = branch_routes(episode.token_ids, session.calls)
        episode.images = branch_images(episode.token_ids, session.calls, seq_len)
        if episode.images:
            episode.metrics["images"] = len(episode.images)
    episode.metrics["sampled_tokens"] = _sampled_tokens(trace, episode)
    episode.metrics["sampled_turns"] = sum(
        1 for node in getattr(trace, "nodes", None) or [] if any(node.mask)
    )
    episode.metrics["trained_turns"] = (
        sum(1 for node in branches[-1].nodes if any(node.mask)) if branches else 0
    )
    for cause in branch_split_causes(branches):
        key = f"branch_splits/{cause}"
        episode.metrics[key] = episode.metrics.get(key, 0) + 1
    # a turn that did not fit seq_len (refused, or clamped by the gateway: session.truncated) makes the
    # episode overlong; the sink's `overlong` policy acts on it (truncate: trained up to there, or drop)
    if overflow := overflow_turn(trace, seq_len):
        episode.metrics["overflow_turn"], episode.metrics["overflow_prompt_tokens"] = overflow
    episode.overlong = bool(overflow or session.truncated or len(episode.token_ids) > seq_len)
    episode.truncated = bool(episode.overlong or trace.is_truncated)
    if len(episode.token_ids) > seq_len:
        for name in ("token_ids", "loss_mask", "sampler_logprobs", "token_versions"):
            setattr(episode, name, getattr(episode, name)[:seq_len])
        if episode.routed_experts is not None:
            episode.routed_experts = episode.routed_experts[:seq_len]
    if not vf_episode.ok or not trace.ok:
        errors = [*trace.errors, *vf_episode.errors]
        message = describe_errors(errors) or "rollout failed"
        kind = "reward" if any(e.type == "TaskError" for e in errors) else "rollout"
        return _error(episode, kind, message[:2000])
    if fault := _reward_fault(trace):
        return _error(episode, "reward", fault)
    episode.reward = float(trace.reward)
    if not any(episode.loss_mask):
        return _error(episode, *_no_sample_cause(trace))
    if not all(math.isfinite(x) for x in episode.sampler_logprobs):
        return _error(episode, "rollout", "non-finite sampler logprob")
    return episode


SplitCause = Literal["template_rerender", "history_rewritten"]


def branch_split_causes(branches: list[Any]) -> list[SplitCause]:
    """Why each branch after the first split off (one cause per extra branch), from where it departs
    from the earlier branch it shares the longest prefix with: `template_rerender` when the first
    differing node holds the same message (the chat extended the earlier one, but its tokens were
    rendered again: a bridge was declined), else `history_rewritten` (the env changed the messages)."""
    from verifiers.v1.graph import message_hash

    causes: list[SplitCause] = []
    for i, branch in enumerate(branches[1:], start=1):
        best, at = None, -1
        for earlier in branches[:i]:
            n = next(
                (j for j, (a, b) in enumerate(zip(earlier.nodes, branch.nodes, strict=False)) if a is not b),
                min(len(earlier.nodes), len(branch.nodes)),
            )
            if n > at:
                best, at = earlier, n
        ours = branch.nodes[at] if at < len(branch.nodes) else None
        theirs = best.nodes[at] if best is not None and at < len(best.nodes) else None
        same = (
            ours is not None
            and theirs is not None
            and message_hash(ours.message) == message_hash(theirs.message)
        )
        causes.append("template_rerender" if same else "history_rewritten")
    return causes


def overflow_turn(trace: Any, seq_len: int) -> tuple[int, int] | None:
    """(turn, prompt tokens) of the trace's first model call that did not fit `seq_len`, turns counted
    from 1 over the trace's calls (failed ones included): a prompt the renderers client refused as longer
    than `seq_len` (its `OverlongPromptError`, on the call as a ProviderError), or a call whose prompt +
    reply reached `seq_len` with finish "length" (the gateway clamped its `max_tokens`). None: all fit."""
    for turn, call in enumerate(getattr(trace, "calls", None) or [], start=1):
        if call.error is not None:
            if match := _OVERLONG.search(call.error.message or ""):
                return turn, int(match[1])
            continue
        usage = getattr(call, "usage", None)  # a call without usage (none reported) cannot tell
        used = usage.prompt_tokens + usage.completion_tokens if usage else 0
        if getattr(call, "finish_reason", None) == "length" and used >= seq_len:
            return turn, int(usage.prompt_tokens)
    return None


def _sampled_tokens(trace: Any, episode: Episode) -> int:
    """Tokens the trace's seat sampled, every turn of every branch counted once (`Trace.nodes`' masks);
    the length bias's unit (`orchestrator/length_bias.py`). Without nodes: the trained branch's."""
    nodes = getattr(trace, "nodes", None)
    if not nodes:
        return sum(episode.loss_mask)
    return sum(sum(node.mask) for node in nodes)


def _no_sample_cause(trace: Any) -> tuple[EnvErrorKind, str]:
    """(kind, message) of an episode in which the policy sampled no token: the first failed model call
    when there is one (that is the cause; the empty reply is its symptom)."""
    failed = next((c.error for c in getattr(trace, "calls", []) if c.error is not None), None)
    if failed is None:
        return "empty_completion", "the policy sampled no token"
    if match := _OVERLONG.search(failed.message):
        prompt, limit = int(match[1]), int(match[2])
        return "prompt_too_long", (
            f"the prompt is {prompt} tokens (chat template and tool schemas included) and does not fit "
            f"seq_len = {limit}: raise seq_len above {prompt} plus the completion budget, or shorten the "
            "prompt"
        )
    return "model_call", f"the first model call failed: {failed.type}: {failed.message}"[:2000]
