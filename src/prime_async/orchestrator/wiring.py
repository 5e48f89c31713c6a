"""Production wiring of the orchestrator's environments and in-run eval (called by `orchestrator._run`).

    cfg.envs      ──► one verifiers rollout source per training env (each with its own gateway)
    cfg.eval.envs ──► one rollout source per eval env, on the training engines (shared) or on the eval
                      engines `cfg.eval.base_urls` (dedicated / external) ──► InRunEval

Invariants:
- every gateway in front of the training engines (training envs, and eval envs of the shared placement)
  reports engine outages to the weight watcher and passes the watcher's one request gate, so an
  `in_place` update holds all of their requests alike;
- dedicated eval engines must belong to the run (run id), like the training engines; external ones are
  not checked (any SGLang-compatible server);
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.engine_api import EngineClient
from prime_async.eval.episodes import EvalResult
from prime_async.eval.in_run import InRunEval, due_versions
from prime_async.eval.setup import eval_envs, tokenizer_decode, write_samples
from prime_async.rollouts.engine_checks import check_engines_belong_to_run, wait_for_engines
from prime_async.rollouts.sources import build_sources
from prime_async.weights.request_gate import RequestGate
from prime_async.weights.watcher import BroadcastDir, WeightWatcher

if TYPE_CHECKING:
    from prime_async.rollouts.source import VerifiersRolloutSource
    from prime_async.utils.monitor import Monitor

logger = logging.getLogger(__name__)


def shared_request_gate(sources: list[VerifiersRolloutSource]) -> RequestGate | None:
    """The one request gate of the run's training engines, given to every gateway of `sources`; None
    when no source has a gateway (the watcher then holds admission for the `in_place` flush instead).

    Built before the weight watcher, which gets it in its constructor: later gateways (shared-placement
    eval) join this gate with `attach_gateways`, they never replace it."""
    gateways = _gateways(sources)
    if not gateways:
        return None
    gate = RequestGate()
    for gateway in gateways:
        gateway.gate = gate
    return gate


def attach_gateways(sources: list[VerifiersRolloutSource], watcher: WeightWatcher) -> None:
    """Gateways in front of the training engines report outages to the watcher (dispatch is held at
    once) and pass the watcher's request gate, so an `in_place` update holds every one of their requests
    until the flush (training and shared eval alike)."""
    for gateway in _gateways(sources):
        gateway.on_engine_error = watcher.engine_failed
        if watcher.request_gate is not None:
            gateway.gate = watcher.request_gate


def _gateways(sources: list[VerifiersRolloutSource]) -> list[Any]:
    return [g for s in sources if (g := getattr(s, "gateway", None)) is not None]


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
    if ecfg.placement != "shared":
        lora = cfg.lora is not None and ecfg.placement == "dedicated"  # our engines: adapters of this run
        eval_engines = engine_clients(ecfg.base_urls, ecfg.api_key, lora=lora)
        for engine in eval_engines:
            stack.push_async_callback(engine.aclose)
        await wait_for_engines(eval_engines, timeout_s=cfg.inference.timeout_s)
        if ecfg.placement == "dedicated":
            await check_engines_belong_to_run(
                eval_engines,
                cfg.run_id,
                model_path=str(cfg.model.path),
                broadcasts=cfg.output_dir / "broadcasts",
            )
    sources = build_sources(list(ecfg.envs), eval_engines, model_path=cfg.model.path, seq_len=cfg.seq_len)
    for source in sources.values():
        await stack.enter_async_context(source)
    if ecfg.placement == "shared":
        attach_gateways(list(sources.values()), watcher)
    envs = eval_envs(
        ecfg.envs, list(sources.values()), base_sampling=cfg.sampling, eval_sampling=ecfg.sampling
    )
    return InRunEval(
        cfg=ecfg, envs=envs, on_result=_eval_logger(cfg, monitor),
        due=due_versions(ecfg, max_steps=cfg.max_steps, start_version=watcher.served_version),
        served_version=lambda: watcher.served_version,
        broadcasts=BroadcastDir(cfg.output_dir / "broadcasts"),
        pin=watcher.pin, update_engines=watcher.update_to,
        engines=eval_engines if ecfg.placement != "shared" else (),
        progress=lambda: watcher.groups.next_batch_step,
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
