"""The trainer as a real process on the tiny model, fed over ZeroMQ: weights out, metrics, resume, DP=2."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer_harness import batch, read_metrics, start_trainer, wait, write_config

from prime_async.testing.synthetic import transport_cfg
from prime_async.transport.zmq_batches import BatchSender

METRIC_KEYS = {
    "loss/total",
    "mismatch_kl",
    "ratio/mean",
    "ratio/std",
    "ratio/min",
    "ratio/max",
    "masked_fraction",
    "entropy",
    "optim/grad_norm",
    "optim/lr",
    "optim/num_steps",
    "offpolicy/effective_steps/mean",
    "offpolicy/effective_steps/max",
    "mismatch_kl/on_policy",
    "offpolicy/on_policy_tokens",
    "offpolicy/unknown_version_tokens",
    "time/wait_for_batch",
    "time/train",
    "time/publish_weights",
    "perf/tokens_per_s",
}


def _feed(sender: BatchSender, steps: range, num_ranks: int, model_dir: Path) -> threading.Thread:
    batches = [batch(s, num_ranks, model_dir=model_dir) for s in steps]
    t = threading.Thread(target=lambda: [sender.send(b) for b in batches], daemon=True)
    t.start()
    return t


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


@pytest.mark.slow
def test_three_steps_then_resume(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out, log = tmp_path / "run", tmp_path / "trainer.log"
    tcfg = transport_cfg(timeout_s=600)
    config = write_config(
        tmp_path / "t.toml", model_dir=tiny_model_dir, output_dir=out, transport=tcfg, max_steps=3
    )
    with BatchSender(cfg=tcfg, num_ranks=1, resend_window=4) as sender:
        feeder = _feed(sender, range(3), 1, tiny_model_dir)
        wait(start_trainer(config, log=log), log)
        feeder.join(5)
        start = _weights(tiny_model_dir)
        previous = start
        for v in (1, 2, 3):
            d = out / "broadcasts" / f"step_{v}"
            assert (
                (d / "STABLE").is_file()
                and (d / "config.json").is_file()
                and (d / "tokenizer.json").is_file()
            )
            w = _weights(d)
            assert set(w) == set(start)
            assert any(not torch.equal(w[k], previous[k]) for k in w), f"step_{v} equals the version before"
            previous = w
        model = AutoModelForCausalLM.from_pretrained(out / "broadcasts" / "step_3")
        torch.testing.assert_close(
            model.state_dict()["model.embed_tokens.weight"], previous["model.embed_tokens.weight"]
        )
        lines = read_metrics(out)
        assert [m["step"] for m in lines] == [0, 1, 2]
        assert set(lines[0]) >= METRIC_KEYS
        assert 0.9 < lines[0]["ratio/mean"] < 1.1 and lines[0]["masked_fraction"] < 0.1
        assert lines[0]["optim/grad_norm"] > 0 and lines[0]["loss/total"] != 0

        # restart with --ckpt.resume: an incomplete newer checkpoint is skipped, it goes on at step 3 -> v4
        (out / "checkpoints" / "trainer" / "step_9").mkdir()
        _feed(sender, range(3, 4), 1, tiny_model_dir)
        wait(start_trainer(config, "--ckpt.resume", "--max-steps", "4", log=log), log)
    text = log.read_text()
    assert "skipping incomplete checkpoint" in text and "next step 3" in text
    assert (out / "broadcasts" / "step_4" / "STABLE").is_file()
    assert [m["step"] for m in read_metrics(out)] == [0, 1, 2, 3]
    assert sorted(p.name for p in (out / "checkpoints" / "trainer").iterdir()) == [
        "step_3",
        "step_4",
        "step_9",
    ]


@pytest.mark.slow
@pytest.mark.needs_devices(2)
@pytest.mark.parametrize("num_steps", [1, 2], ids=["one_step_per_batch", "two_steps_per_batch"])
def test_torchrun_two_ranks_match_one(num_steps: int, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Plain single process (no process group, unsharded) vs torchrun with 2 gloo ranks (FSDP2).

    With two optimizer steps per batch the ranks split their rows [r0, r2] / [r1, pad] into mini-batches
    [r0] + [r1] and [r2] + [pad]: the single process's [r0, r1] and [r2]. Token versions are 0, so the
    effective distance of batch n is 2n in the first mini-batch and 2n + 1 in the second."""
    losses = {}
    for nproc in (None, 2):
        out, log = tmp_path / f"run{nproc}", tmp_path / f"trainer{nproc}.log"
        tcfg = transport_cfg(timeout_s=600)
        config = write_config(
            tmp_path / f"t{nproc}.toml",
            model_dir=tiny_model_dir,
            output_dir=out,
            transport=tcfg,
            max_steps=3,
            ckpt={"keep": 2},
            optim={"lr": 1e-3, "max_grad_norm": 1.0, "num_steps_per_batch": num_steps},
        )
        with BatchSender(cfg=tcfg, num_ranks=nproc or 1) as sender:
            feeder = _feed(sender, range(3), nproc or 1, tiny_model_dir)
            wait(start_trainer(config, nproc=nproc, log=log), log)
            feeder.join(5)
        metrics = read_metrics(out)
        assert len(metrics) == 3
        assert [m["optim/num_steps"] for m in metrics] == [num_steps] * 3
        assert [m["offpolicy/effective_steps/max"] for m in metrics] == [
            n * num_steps + num_steps - 1 for n in range(3)
        ]
        keys = ("loss/total", "optim/grad_norm", "mismatch_kl", "offpolicy/effective_steps/mean")
        losses[nproc] = [tuple(m[k] for k in keys) for m in metrics]
    for one, two in zip(losses[None], losses[2], strict=True):
        assert one == pytest.approx(two, abs=1e-4, rel=1e-4)
    w1 = load_file(str(tmp_path / "runNone" / "broadcasts" / "step_3" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "run2" / "broadcasts" / "step_3" / "model.safetensors"))
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-4, atol=1e-5)
