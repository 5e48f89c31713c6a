"""The megatron trainer loop end to end: batches over real ZeroMQ in, HF weight versions out.

A `BatchSender` (the orchestrator's side) streams two batches to the trainer loop (megatron backend)
running under torchrun with TP=2 (two processes, each receiving its own share), or as one plain process;
the loop must publish `broadcasts/step_1` and `step_2` (STABLE last) that plain transformers loads, and
log the trainer metrics to the JSONL. Each batch is trained as two mini-batches (`optim.num_steps_per_batch
= 2`): two optimizer steps, one published version.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the `megatron` extra")

from loop_runner import run_megatron_loop, trainer_metrics


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc",
    [
        pytest.param(2, id="torchrun_tp2", marks=pytest.mark.needs_devices(2)),
        pytest.param(1, id="single_process"),
    ],
)
def test_megatron_loop_trains_and_publishes(nproc: int, tiny_model_dir: Path, tmp_path: Path) -> None:
    """nproc = 1 runs without torchrun: the backend opens its own world-size-1 process group."""
    run_megatron_loop(
        model_dir=tiny_model_dir,
        out=tmp_path / "run",
        config_dir=tmp_path,
        nproc=nproc,
        steps=range(2),
        optim={"num_steps_per_batch": 2},
    )

    from transformers import AutoModelForCausalLM

    broadcasts = tmp_path / "run" / "broadcasts"
    assert (broadcasts / "step_1" / "STABLE").is_file() and (broadcasts / "step_2" / "STABLE").is_file()
    v1 = AutoModelForCausalLM.from_pretrained(broadcasts / "step_1", dtype=torch.float32)
    v2 = AutoModelForCausalLM.from_pretrained(broadcasts / "step_2", dtype=torch.float32)
    v0 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    w = "model.layers.0.mlp.up_proj.weight"
    s0, s1, s2 = (m.state_dict()[w] for m in (v0, v1, v2))
    assert not torch.equal(s0, s1) and not torch.equal(s1, s2)
    lines = trainer_metrics(tmp_path / "run")
    assert [x["step"] for x in lines] == [0, 1]
    assert all(x["optim/grad_norm"] > 0 and "loss/total" in x and "mismatch_kl" in x for x in lines)
    # token versions 0: batch n's mini-batches are 2n and 2n + 1 optimizer steps off-policy
    assert [x["optim/num_steps"] for x in lines] == [2, 2]
    assert [x["offpolicy/effective_steps/max"] for x in lines] == [1, 3]
    assert (
        0
        < lines[0]["offpolicy/effective_steps/mean"]
        < 1
        < 2
        < lines[1]["offpolicy/effective_steps/mean"]
        < 3
    )
