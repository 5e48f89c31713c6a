"""The doctor end to end: probe every env on version 0, score the probes, run K = 0 for a few steps.

Order: the engine starts, every env's probes run, the engine stops (before the trainer model loads and
before the K = 0 run, which starts its own processes: two runs never share the 2 cores of a laptop); the
trainer model scores the probes; the K = 0 run. Each stage's failure to run at all (an env that cannot
load, an engine that does not start) raises with the stage named: the table only reports checks that ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

from prime_async.config.lint import lint_rl
from prime_async.config.rl import RLConfig
from prime_async.doctor import checks
from prime_async.doctor.checks import CheckResult
from prime_async.doctor.images import ImageEcho, echo_images, image_prompt_fits, image_round_trip
from prime_async.doctor.logprobs import mismatch_kl
from prime_async.doctor.probe import EnvProbes, collect, start_engine
from prime_async.doctor.report import render
from prime_async.doctor.sync_run import NAME as K0_NAME
from prime_async.doctor.sync_run import run_k0
from prime_async.doctor.vocab import engine_answer, vocab_check

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DoctorOptions:
    examples: int = 4
    longest: int = 2
    repeats: int = 2
    sync_steps: int = 3  # 0 = no K = 0 run
    timeout_s: float = 600.0


def env_rows(
    cfg: RLConfig, probes: EnvProbes, echoes: list[ImageEcho] | None = None
) -> list[tuple[str, CheckResult]]:
    """The probe checks of one env (the logprob check loads the trainer model); a vision-language
    model's (`echoes` given) also the image-prompt checks (`doctor/images.py`)."""
    sampling = probes.sampling
    max_tokens = sampling.max_tokens if sampling else None
    episodes = [e for p in probes.probes for e in p.ok]
    kl, tokens = mismatch_kl(cfg, episodes, sampling.temperature if sampling else 1.0)
    results = [
        checks.token_round_trip(probes.probes + [p for pair in probes.pairs for p in pair]),
        checks.same_seed_same_reward(probes.pairs),
        checks.prompt_fits(probes.probes, seq_len=cfg.seq_len, max_tokens=max_tokens),
        checks.episode_fits(probes.probes, seq_len=cfg.seq_len, max_tokens=max_tokens),
        checks.mismatch_kl(kl, tokens),
    ]
    if echoes is not None:
        results.insert(1, image_round_trip(echoes))
        results.insert(4, image_prompt_fits(probes.probes, seq_len=cfg.seq_len, max_tokens=max_tokens))
    return [(probes.env, r) for r in results]


def _echoes(cfg: RLConfig, url: str, probes: EnvProbes, timeout_s: float) -> list[ImageEcho] | None:
    """A vision-language model's image calls of one env sent back to the engine at `url`; None for a
    text model (no image rows)."""
    from prime_async.rollouts.images import image_placer

    if image_placer(cfg.model.path) is None:
        return None
    temperature = probes.sampling.temperature if probes.sampling else 1.0
    every = probes.probes + [p for pair in probes.pairs for p in pair]
    coro = echo_images(url, cfg.orchestrator.inference.api_key, every, temperature)
    return asyncio.run(asyncio.wait_for(coro, timeout=timeout_s))


def diagnose(
    cfg: RLConfig, rl_argv: list[str], out_dir: Path, opts: DoctorOptions
) -> list[tuple[str, CheckResult]]:
    from prime_async.launcher.rl import ensure_model

    ensure_model(cfg)
    with contextlib.ExitStack() as stack:
        url = start_engine(cfg, out_dir, stack)
        coro = collect(cfg, [url], examples=opts.examples, longest=opts.longest, repeats=opts.repeats)
        all_probes = asyncio.run(asyncio.wait_for(coro, timeout=opts.timeout_s))
        vocab = None if cfg.lora is not None else asyncio.run(engine_answer(cfg, url))
        echoes = [_echoes(cfg, url, probes, opts.timeout_s) for probes in all_probes]
    rows = [
        row for probes, echo in zip(all_probes, echoes, strict=True) for row in env_rows(cfg, probes, echo)
    ]
    rows.append(("model", vocab_check(cfg, vocab)))
    if opts.sync_steps:
        rows.append(
            ("run", run_k0(rl_argv, out_dir / "k0-run", steps=opts.sync_steps, timeout_s=opts.timeout_s))
        )
    else:
        rows.append(("run", CheckResult(K0_NAME, None, "not run (--sync-steps 0)")))
    return rows


def doctor(cfg: RLConfig, rl_argv: list[str], out_dir: Path, opts: DoctorOptions) -> tuple[str, bool]:
    """The report (with the config lint's warnings) and whether every check that ran passed (a lint
    warning never fails it)."""
    rows = diagnose(cfg, rl_argv, out_dir, opts)
    warnings = [finding.line() for finding in lint_rl(cfg)]
    return render(rows, warnings), not any(r.passed is False for _, r in rows)
