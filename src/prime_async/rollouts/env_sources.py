"""The rollout sources of a run's env configs (one `VerifiersRolloutSource` each, keyed by env name), and
their metrics summed and per env: shared by training (`orchestrator/`) and eval.

Invariant: the env metrics of all sources are summed under `env/episodes/<status>`, `env/errors/<kind>`,
`env/gateway_requests`, and also reported per env as `env/<name>/episodes/<status>` and
`env/<name>/errors/<kind>` (and `env/<name>/branch_splits/<cause>`, `env/<name>/overflow_episodes`,
`env/<name>/images`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prime_async.engine_api import EngineClient
from prime_async.rollouts.types import RolloutSource
from prime_async.weights.request_gate import RequestGate


def build_sources(
    envs: list[Any],
    engines: list[EngineClient],
    *,
    model_path: str,
    seq_len: int,
    gate: RequestGate | None = None,
) -> dict[str, Any]:
    """An unstarted verifiers rollout source per env config of `envs`, keyed by env name; every gateway
    passes `gate` (the run's one gate in front of `engines`; None: each its own)."""
    from prime_async.rollouts.verifiers_source import build_rollout_source

    return {
        env.label: build_rollout_source(
            env_cfg=env, engines=engines, model_path=model_path, seq_len=seq_len, gate=gate
        )
        for env in envs
    }


def source_metrics(sources: Mapping[str, RolloutSource]) -> dict[str, float]:
    """Env metrics of every source, summed and per env (module docstring)."""
    out: dict[str, float] = {}
    for name, source in sources.items():
        for key, value in source.metrics().items():
            out[key] = out.get(key, 0.0) + value
            if key.startswith(
                ("env/episodes/", "env/errors/", "env/branch_splits/", "env/overflow_", "env/images")
            ):
                out[f"env/{name}/{key.removeprefix('env/')}"] = value
    return out
