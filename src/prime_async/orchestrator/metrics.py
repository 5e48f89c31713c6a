"""Per-batch rollout metrics of the groups trained at step `n` (DESIGN.md names).

For every trained episode with span (start=d, end):
    staleness = n - d = version_span + queue_steps,  version_span = end - d,  queue_steps = n - end
so `rollout/data_staleness/mean == rollout/version_span/mean + rollout/queue_steps/mean` exactly.
`rollout/data_staleness/ratio_<k>` is the fraction of trained groups with staleness k.
"""

from __future__ import annotations

import math
from collections import Counter

from prime_async.orchestrator.types import Group


def batch_metrics(groups: list[Group], step: int) -> dict[str, float]:
    staleness: list[int] = []
    spans: list[int] = []
    queues: list[int] = []
    rewards: list[float] = []
    completion_tokens = 0
    truncated = 0
    for group in groups:
        for ep in group.episodes:
            assert ep.span is not None, "trained episode without a PolicySpan"
            staleness.append(step - group.dispatch_version)
            spans.append(ep.span.end - ep.span.start)
            queues.append(step - ep.span.end)
            rewards.append(ep.reward if ep.reward is not None else 0.0)
            completion_tokens += ep.num_completion_tokens
            truncated += int(ep.truncated)
    n = max(len(staleness), 1)
    mean_reward = sum(rewards) / n
    out = {
        "rollout/data_staleness/mean": sum(staleness) / n,
        "rollout/data_staleness/max": float(max(staleness, default=0)),
        "rollout/version_span/mean": sum(spans) / n,
        "rollout/queue_steps/mean": sum(queues) / n,
        "reward/mean": mean_reward,
        "reward/std": math.sqrt(sum((r - mean_reward) ** 2 for r in rewards) / n),
        "rollout/trained_groups": float(len(groups)),
        "rollout/trained_completion_tokens": float(completion_tokens),
        "rollout/truncated_fraction": truncated / n,
    }
    group_staleness = Counter(step - g.dispatch_version for g in groups)
    for k in range(max(group_staleness, default=0) + 1):
        out[f"rollout/data_staleness/ratio_{k}"] = group_staleness[k] / max(len(groups), 1)
    return out
