"""The weight probe against the real embedded engine (a subprocess on the tiny model): the trainer's
reference (HF forward, `trainer/probe_reference.py`) matches the engine's answer over the full vocabulary
on a good load, and a load with one tensor perturbed is caught at that version with one ERROR line."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch

from prime_async.config.probe import WeightProbeConfig
from prime_async.inference.client import HttpEngineClient
from prime_async.trainer.probe_reference import ProbeBuilder, probe_logits
from prime_async.weights.probe_check import WeightProbe
from proc_helpers import start_embedded_engine

PERTURBED = "model.norm.weight"  # the final norm: every position's logits


def _corrupted(src: Path, dst: Path) -> Path:
    """`src` with one tensor perturbed (what a broken load would leave in the engine)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        state = load_file(str(f))
        if PERTURBED in state:
            gen = torch.Generator().manual_seed(0)
            state[PERTURBED] = state[PERTURBED] + 2.0 * torch.randn(state[PERTURBED].shape, generator=gen)
            save_file(state, str(f))
    return dst


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("probe_engine")
    config = (
        f'backend = "torch"\nseq_len = 512\noutput_dir = "{work}"\n[model]\npath = "{tiny_model_dir}"\n'
        'dtype = "float32"\n[engine]\nmax_running_requests = 4\nnum_threads = 1\n'
    )
    url, proc = start_embedded_engine(config, work, timeout_s=300)
    yield url
    proc.terminate()
    proc.wait(30)


def test_probe_passes_a_good_load_and_catches_a_perturbed_tensor(
    engine_url: str, tiny_model_dir: Path, tmp_path: Path, caplog
):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    cfg = WeightProbeConfig(top_k=model.config.vocab_size)  # the full vocabulary
    builder = ProbeBuilder.from_model_path(cfg, str(tiny_model_dir))
    reference = builder.reference(probe_logits(model, builder.sequences))
    client = HttpEngineClient(engine_url)
    probe = WeightProbe(cfg, [client])

    async def run() -> tuple:
        probe.remember(1, reference)
        good = await probe.check(1)
        await client.update_weights_from_disk(
            str(_corrupted(tiny_model_dir, tmp_path / "bad")), 2, flush_cache=True
        )
        probe.remember(2, reference)  # the trainer's weights of v2 are the good ones
        return good, await probe.check(2)

    with caplog.at_level(logging.ERROR):
        good, bad = asyncio.run(run())
    print(f"good load: {good}\ncorrupted load: {bad}")
    assert good.max_abs_logprob_diff < 1e-3 and good.kl < 1e-5 and good.tv < 1e-3
    assert bad.max_abs_logprob_diff > cfg.max_logprob_diff or bad.kl > cfg.max_kl
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    print(*errors, sep="\n")
    assert len(errors) == 1 and errors[0].startswith("weights v2: ")
