"""Per-batch rollout metrics of the groups trained at step `n` (DESIGN.md names).

For every trained episode with span (start=d, end):
    staleness = n - d = version_span + queue_steps,  version_span = end - d,  queue_steps = n - end
so `rollout/data_staleness/mean == rollout/version_span/mean + rollout/queue_steps/mean` exactly.
`rollout/token_staleness/{mean,max}` is `n - v` over the batch's loss tokens (`v` the version each was
sampled under, the dispatch version when unknown): what K bounds under the token rule (`stragglers =
"partial"`, where a straggler's group staleness can exceed K and its older tokens were masked), and
`rollout/straggler_groups` counts the groups of the batch with `n - d > K`.
`rollout/data_staleness/ratio_<k>` is the fraction of trained groups with staleness k. A multi-agent
env's trajectories also give `reward/seat/<seat>/mean` per seat. Per training environment (`env_names`):
`rollout/env/<name>/trained_groups` (0 when the batch has none of it), and for those in the batch
`reward/<name>/mean`, `rollout/env/<name>/data_staleness/mean`, and the env's own values
(`rollouts/episode.env_values`): `env/<name>/metric/<metric>` (each `@vf.metric`) and
`env/<name>/reward_fn/<reward>` (each reward function's unweighted score), each the mean over the batch's
trajectories of that env that carry it. A batch with images (a vision-language model) also gives
`rollout/images_per_episode`: the mean over its trajectories of `len(Episode.images)` (left out when no
trajectory has one, so text runs log no such key).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from prime_async.orchestrator.token_staleness import loss_token_ages
from prime_async.orchestrator.types import Group
from prime_async.rollouts.episode import split_env_values


def batch_metrics(
    groups: list[Group], step: int, env_names: Sequence[str] = (), max_off_policy_steps: int | None = None
) -> dict[str, float]:
    staleness: list[int] = []
    spans: list[int] = []
    queues: list[int] = []
    rewards: list[float] = []
    completion_tokens = 0
    truncated = 0
    images = 0
    by_seat: dict[str, list[float]] = {}
    for group in groups:
        for ep in group.episodes:
            by_seat.setdefault(ep.seat, []).append(ep.reward if ep.reward is not None else 0.0)
            assert ep.span is not None, "trained episode without a PolicySpan"
            staleness.append(step - group.dispatch_version)
            spans.append(ep.span.end - ep.span.start)
            queues.append(step - ep.span.end)
            rewards.append(ep.reward if ep.reward is not None else 0.0)
            completion_tokens += ep.num_completion_tokens
            truncated += int(ep.truncated)
            images += len(ep.images)
    n = max(len(staleness), 1)
    mean_reward = sum(rewards) / n
    out = {
        "rollout/data_staleness/mean": sum(staleness) / n,
        "rollout/data_staleness/max": float(max(staleness, default=0)),
        "rollout/data_staleness/min": float(min(staleness, default=0)),
        "rollout/version_span/mean": sum(spans) / n,
        "rollout/queue_steps/mean": sum(queues) / n,
        "reward/mean": mean_reward,
        "reward/std": math.sqrt(sum((r - mean_reward) ** 2 for r in rewards) / n),
        "rollout/trained_groups": float(len(groups)),
        "rollout/trained_completion_tokens": float(completion_tokens),
        "rollout/trained_completion_tokens/mean": completion_tokens / n,
        "rollout/truncated_fraction": truncated / n,
    }
    if images:
        out["rollout/images_per_episode"] = images / n
    if set(by_seat) != {"agent"}:
        out.update({f"reward/seat/{seat}/mean": sum(r) / len(r) for seat, r in by_seat.items()})
    out.update(env_metrics(groups, step, env_names))
    out.update(token_staleness_metrics(groups, step, max_off_policy_steps))
    group_staleness = Counter(step - g.dispatch_version for g in groups)
    for k in range(max(group_staleness, default=0) + 1):
        out[f"rollout/data_staleness/ratio_{k}"] = group_staleness[k] / max(len(groups), 1)
    return out


def token_staleness_metrics(groups: list[Group], step: int, k: int | None) -> dict[str, float]:
    """`rollout/token_staleness/{mean,max}` over the loss tokens, `rollout/straggler_groups` (module doc)."""
    ages = [age for group in groups for age in loss_token_ages(group, step)]
    out = {
        "rollout/token_staleness/mean": sum(ages) / max(len(ages), 1),
        "rollout/token_staleness/max": float(max(ages, default=0)),
    }
    if k is not None:
        out["rollout/straggler_groups"] = float(sum(step - g.dispatch_version > k for g in groups))
    return out


def env_metrics(groups: list[Group], step: int, env_names: Sequence[str]) -> dict[str, float]:
    """The batch split by training environment (module docstring)."""
    out = {f"rollout/env/{name}/trained_groups": 0.0 for name in env_names}
    rewards: dict[str, list[float]] = {}
    staleness: dict[str, list[int]] = {}
    for group in groups:
        key = f"rollout/env/{group.env}/trained_groups"
        out[key] = out.get(key, 0.0) + 1
        rewards.setdefault(group.env, []).extend(group.rewards)
        staleness.setdefault(group.env, []).extend([step - group.dispatch_version] * len(group.episodes))
    for name, values in rewards.items():
        out[f"reward/{name}/mean"] = sum(values) / max(len(values), 1)
        out[f"rollout/env/{name}/data_staleness/mean"] = sum(staleness[name]) / max(len(staleness[name]), 1)
    out.update(env_value_means(groups))
    return out


def env_value_means(groups: list[Group]) -> dict[str, float]:
    """`env/<name>/metric/<metric>` and `env/<name>/reward_fn/<reward>`: means over the trajectories that
    carry the value (module docstring)."""
    sums: dict[str, list[float]] = {}
    for group in groups:
        for ep in group.episodes:
            metrics, rewards = split_env_values(ep.metrics)
            for kind, values in (("metric", metrics), ("reward_fn", rewards)):
                for key, value in values.items():
                    sums.setdefault(f"env/{group.env}/{kind}/{key}", []).append(float(value))
    return {key: sum(values) / len(values) for key, values in sums.items()}
