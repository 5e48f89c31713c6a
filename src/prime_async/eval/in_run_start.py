"""Starting the in-run eval of a training run (called by the orchestrator's `main._run_lifetime`).

    cfg.eval.envs ──► one rollout source per eval env, on the training engines (shared) or on the eval
                      engines `cfg.eval.base_urls` (dedicated / external) ──► InRunEval

Invariants:
- the gateways of a shared-placement eval pass the watcher's one request gate (the gate the training
  envs' gateways were built with, `orchestrator/main.py`), so an `in_place` update holds all of their
  requests alike and their engine outages hold dispatch;
- dedicated eval engines must belong to the run (run id), like the training engines; external ones are
  not checked (any SGLang-compatible server).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.engine_api import EngineClient
from prime_async.eval.episodes import EvalResult
from prime_async.eval.in_run import InRunEval, TrainingSide, due_versions
from prime_async.eval.setup import eval_envs, tokenizer_decode, write_samples
from prime_async.rollouts.engine_checks import check_engines_belong_to_run, wait_for_engines
from prime_async.rollouts.env_sources import build_sources
from prime_async.weights.broadcasts import BroadcastDir
from prime_async.weights.loaders import broadcast_loader
from prime_async.weights.watcher import WeightWatcher

if TYPE_CHECKING:
    from prime_async.utils.monitor import Monitor

logger = logging.getLogger(__name__)


async def start_in_run_eval(
    cfg: OrchestratorConfig, watcher: WeightWatcher, *, engines: list[EngineClient], monitor: Monitor,
    stack: contextlib.AsyncExitStack,
) -> InRunEval | None:  # fmt: skip
    """The in-run eval of `cfg.eval` with its sources started on `stack`; None without eval envs."""
    ecfg = cfg.eval
    if not ecfg.enabled:
        return None
    from prime_async.inference.client import engine_clients

    eval_engines: list[EngineClient] = engines
    lora = cfg.inference.lora is not None and ecfg.placement == "dedicated"  # ours: this run's adapters
    if ecfg.placement != "shared":
        eval_engines = engine_clients(ecfg.base_urls, ecfg.api_key, lora=lora)
        for engine in eval_engines:
            stack.push_async_callback(engine.aclose)
        await wait_for_engines(eval_engines, timeout_s=cfg.inference.timeout_s)
        if ecfg.placement == "dedicated":
            await check_engines_belong_to_run(
                eval_engines,
                cfg.inference.run_id,
                model_path=str(cfg.model.path),
                broadcasts=cfg.output_dir / "broadcasts",
            )
    # shared placement: the eval's gateways pass the watcher's one gate (in_place holds them too, and
    # their engine outages hold dispatch); dedicated/external engines get gates of their own
    gate = watcher.request_gate if ecfg.placement == "shared" else None
    sources = build_sources(
        list(ecfg.envs), eval_engines, model_path=cfg.model.path, seq_len=cfg.seq_len, gate=gate
    )
    for source in sources.values():
        await stack.enter_async_context(source)
    envs = eval_envs(
        ecfg.envs, list(sources.values()), base_sampling=cfg.sampling, eval_sampling=ecfg.sampling
    )
    return InRunEval(
        cfg=ecfg, envs=envs, on_result=_eval_logger(cfg, monitor),
        due=due_versions(ecfg, max_steps=cfg.max_steps, start_version=watcher.served_version),
        training=TrainingSide(
            served_version=lambda: watcher.served_version, progress=lambda: watcher.groups.next_batch_step,
            pin=watcher.pin, update_engines=watcher.update_to,
        ),
        loader=broadcast_loader(BroadcastDir(cfg.output_dir / "broadcasts"), lora=lora),
        engines=eval_engines if ecfg.placement != "shared" else (),
        decode=tokenizer_decode(cfg.model.path) if ecfg.samples or ecfg.wandb_table else None,
    )  # fmt: skip


def _eval_logger(cfg: OrchestratorConfig, monitor: Monitor) -> Any:
    def on_result(result: EvalResult) -> None:
        monitor.log_eval(result.metrics, version=result.version)
        if cfg.eval.samples:
            write_samples(cfg.output_dir / "eval" / f"samples_v{result.version}.jsonl", result.samples)
        if cfg.eval.wandb_table:
            monitor.log_table("eval/samples", result.samples)

    return on_result
