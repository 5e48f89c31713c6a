"""How many versions the distributed transport holds on each side (deterministic x distributed x K).

A deterministic run loads every version in turn while the trainer runs up to K + 1 versions ahead of
the served one, so the trainer must hold K + 1 snapshots and the orchestrator remember as many
announcements; with 2 and 4, `SendWeights(v1)` was refused ("versions held: [2, 3]") at K >= 2 whenever
the watcher fell behind, and the orchestrator exited."""

from __future__ import annotations

import pytest

from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.config.trainer import TrainerConfig
from prime_async.weights.publishers.base import KEEP_SNAPSHOTS, snapshots_to_keep


@pytest.mark.parametrize("k", [0, 1, 2, 3, 8])
def test_deterministic_trainer_holds_k_plus_1_versions(k: int) -> None:
    cfg = TrainerConfig(deterministic=True, max_off_policy_steps=k, weights={"transport": "distributed"})
    assert snapshots_to_keep(cfg) == max(KEEP_SNAPSHOTS, k + 1)
    assert snapshots_to_keep(TrainerConfig(max_off_policy_steps=k)) == KEEP_SNAPSHOTS, "newest-only runs"


def test_deterministic_orchestrator_remembers_every_loadable_announcement() -> None:
    from prime_async.weights.loaders import build_control
    from prime_async.weights.watcher import UpdateSignal
    from proc_helpers import free_pair

    cfg = OrchestratorConfig(
        deterministic=True, max_off_policy_steps=8, transport={"port": free_pair()},
        weights={"transport": "distributed"},
    )  # fmt: skip

    async def go() -> int:
        control, loader = build_control(cfg, UpdateSignal())
        try:
            return loader.keep_announced
        finally:
            await control.close()

    import asyncio

    assert asyncio.run(go()) >= 8 + 1
