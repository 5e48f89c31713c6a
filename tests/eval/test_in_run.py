"""In-run eval on the simulator (real orchestrator components, simulated engines, virtual clock):
which versions are evaluated, that a shared eval never spans two versions (the pin), that eval episodes
never reach the group table, and that dedicated engines load each evaluated version."""

from __future__ import annotations

from pathlib import Path

import pytest

from prime_async.config.orchestrator import OrchestratorConfig, OrchestratorEvalConfig
from prime_async.eval.in_run import due_versions
from prime_async.simulation import SimParams, run_simulation, run_virtual
from prime_async.weights.watcher import WeightWatcher

EVAL_ENV = {"id": "sim", "name": "heldout", "num_examples": 4, "rollouts_per_example": 2}


def config(tmp_path: Path, **eval_cfg) -> OrchestratorConfig:
    return OrchestratorConfig(
        max_steps=7, batch_groups=2, group_size=2, max_off_policy_steps=2, output_dir=tmp_path,
        wandb={"enabled": False}, eval={"envs": [EVAL_ENV], "interval": 3, **eval_cfg},
    )  # fmt: skip


def test_due_versions_are_start_multiples_of_interval_and_end() -> None:
    cfg = OrchestratorEvalConfig(envs=[EVAL_ENV], interval=3)
    assert due_versions(cfg, max_steps=7, start_version=0) == [0, 3, 6, 7]
    assert due_versions(cfg, max_steps=7, start_version=4) == [6, 7]  # resumed at version 4
    off = OrchestratorEvalConfig(envs=[EVAL_ENV], at_start=False, at_end=False, interval=5)
    assert due_versions(off, max_steps=12, start_version=0) == [5, 10]


def check_evals(result, due: list[int]) -> list[int]:
    versions = [r.version for r in result.evals]
    assert versions == sorted(set(versions)) and versions[0] == 0 and versions[-1] == 7
    assert len(versions) + result.evals[-1].metrics["eval/skipped_versions"] == len(due)
    for r in result.evals:
        assert r.metrics["eval/weight_version"] == r.version
        assert r.metrics["eval/heldout/num_episodes"] == 8
        assert {s["version"] for s in r.samples} == {r.version} and len(r.samples) == 8
    return versions


def test_shared_eval_runs_at_one_version_and_stays_out_of_the_ledger(tmp_path: Path) -> None:
    params = SimParams(seed=3, latency_s=1.0, train_time_s=1.0)
    result = run_virtual(run_simulation(config(tmp_path), params))
    check_evals(result, [0, 3, 6, 7])
    for r in result.evals:  # the pin: no update while an eval runs, so every token has its version
        assert r.metrics["eval/heldout/off_version_tokens"] == 0
    comps = result.comps
    groups_dispatched = comps.dispatcher._next_group_id
    assert comps.groups.dispatched == groups_dispatched * 2  # training episodes only
    assert sorted(result.trained) == list(range(7))
    assert sum(len(g) for g in result.trained.values()) == 14


def test_without_the_pin_a_shared_eval_would_mix_versions(tmp_path: Path, monkeypatch) -> None:
    async def update_unpinned(self: WeightWatcher, version: int, *, force: bool = False) -> None:
        if version > self.served_version or (force and version == self.served_version):
            await self.update(version, force=force)

    monkeypatch.setattr(WeightWatcher, "update_to", update_unpinned)
    params = SimParams(seed=3, latency_s=1.0, train_time_s=1.0)
    result = run_virtual(run_simulation(config(tmp_path), params))
    assert sum(r.metrics["eval/heldout/off_version_tokens"] for r in result.evals) > 0


@pytest.mark.parametrize("placement", ["dedicated", "external"])
def test_eval_engines_load_each_evaluated_version(tmp_path: Path, placement: str) -> None:
    cfg = config(tmp_path, placement=placement, base_urls=["http://127.0.0.1:1", "http://127.0.0.1:2"])
    result = run_virtual(run_simulation(cfg, SimParams(seed=4, latency_s=1.0)))
    versions = check_evals(result, [0, 3, 6, 7])
    for engine in result.eval_engines:
        loaded = [args[1] for kind, args in engine.calls if kind == "update"]
        assert loaded == [v for v in versions if v > 0]
        assert not any(kind == "pause" for kind, _ in engine.calls)  # training updates never touch them
    for r in result.evals:
        assert r.metrics["eval/heldout/off_version_tokens"] == 0


def test_an_eval_engine_hiccup_never_ends_training(tmp_path: Path, monkeypatch) -> None:
    """Regression: a dedicated eval engine answered /model_info with 'Server disconnected', the
    EngineUnavailable escaped the eval task and the orchestrator exited, ending the run. Now a failed
    load or eval is retried, then that version is skipped (`eval/failed_versions`); training goes on."""
    from prime_async.engine_api import EngineUnavailable
    from prime_async.simulation import SimulatedEngine

    real_version, real_update = SimulatedEngine.weight_version, SimulatedEngine.update_weights_from_disk
    hiccups = {"v0": 1}  # v0: the first /model_info of eval engine 100 fails, the retry succeeds

    async def weight_version(self: SimulatedEngine) -> int:
        if self.base_url == "sim://engine100" and hiccups["v0"] > 0:
            hiccups["v0"] -= 1
            raise EngineUnavailable("Server disconnected without sending a response")
        return await real_version(self)

    async def update_weights_from_disk(self: SimulatedEngine, path, version, **kw) -> None:
        if (
            self.base_url == "sim://engine100" and version == 3
        ):  # v3 never loads on this engine: given up, then skipped
            raise EngineUnavailable("Server disconnected without sending a response")
        await real_update(self, path, version, **kw)

    monkeypatch.setattr(SimulatedEngine, "weight_version", weight_version)
    monkeypatch.setattr(SimulatedEngine, "update_weights_from_disk", update_weights_from_disk)
    cfg = config(tmp_path, placement="dedicated", base_urls=["http://127.0.0.1:1", "http://127.0.0.1:2"])
    result = run_virtual(run_simulation(cfg, SimParams(seed=4, latency_s=1.0)))
    assert sorted(result.trained) == list(range(7)), "training ran to the end"
    versions = [r.version for r in result.evals]
    assert 0 in versions and 3 not in versions and versions[-1] == 7
    assert result.evals[-1].metrics["eval/failed_versions"] == 1.0
