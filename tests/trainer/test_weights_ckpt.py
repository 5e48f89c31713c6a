"""Weight publishing (atomic, loadable, retention), checkpoints (round trip, incomplete skipped), LR schedule,
and one in-process train step (padding passes, non-finite rejection)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from prime_async.config.trainer import MaskLossConfig, OptimConfig, TrainerConfig
from prime_async.testing.synthetic import make_batch
from prime_async.trainer.ckpt import checkpoint_root, latest_checkpoint, load_checkpoint, save_checkpoint
from prime_async.trainer.fsdp import train_step
from prime_async.trainer.loss import NonFiniteError, build_loss_fn
from prime_async.trainer.optim import build_optimizer, lr_factor
from prime_async.trainer.train import check_staleness
from prime_async.transport.zmq_batches import RankBatch
from prime_async.weights.writer import BroadcastWriter


@pytest.fixture()
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()


def test_publish_loadable_and_retention(model, tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pub = BroadcastWriter(
        output_dir=tmp_path, model_config=model.config, source_dir=tiny_model_dir, keep_last=2
    )
    for v in range(1, 6):
        with torch.no_grad():
            model.model.norm.weight.fill_(float(v))
        pub.publish(model.state_dict(), v, protected=[2])
    root = tmp_path / "broadcasts"
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4", "step_5"]  # no temp dirs left
    assert all((root / n / "STABLE").is_file() for n in ("step_2", "step_4", "step_5"))
    loaded = AutoModelForCausalLM.from_pretrained(root / "step_5")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v)
    assert torch.all(loaded.model.norm.weight == 5.0)
    AutoTokenizer.from_pretrained(root / "step_5")  # tokenizer files travel with the weights


def test_a_vlm_broadcast_carries_its_image_processor(tiny_vlm_model_dir: Path, tmp_path: Path) -> None:
    """A restarted engine serves the newest broadcast as its model: a VLM's needs the processor files."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoImageProcessor

    config = AutoConfig.from_pretrained(tiny_vlm_model_dir)
    pub = BroadcastWriter(
        output_dir=tmp_path, model_config=config, source_dir=tiny_vlm_model_dir, keep_last=2
    )
    path = pub.publish(load_file(tiny_vlm_model_dir / "model.safetensors"), 1)
    assert (path / "processor_config.json").is_file()
    AutoImageProcessor.from_pretrained(path)  # what the engine's image inputs load (inference/images.py)


def _step(model, opt, sched) -> None:
    model(input_ids=torch.arange(8)[None], labels=torch.arange(8)[None]).loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def test_checkpoint_round_trip_and_incomplete_skipped(model, tmp_path: Path, caplog) -> None:
    cfg = OptimConfig(lr=1e-3, warmup_steps=2)
    opt = build_optimizer(cfg, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg, s, 10))
    _step(model, opt, sched)
    save_checkpoint(output_dir=tmp_path, step=1, model=model, optimizer=opt, scheduler=sched, keep=2)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_lr = opt.param_groups[0]["lr"]
    rng_after_save = torch.rand(3)
    _step(model, opt, sched)  # moves away from the checkpoint
    (checkpoint_root(tmp_path) / "step_7").mkdir()  # crashed mid-write: no COMPLETE
    path = latest_checkpoint(tmp_path)
    assert path == checkpoint_root(tmp_path) / "step_1"
    assert "skipping incomplete checkpoint" in caplog.text
    assert load_checkpoint(path, model=model, optimizer=opt, scheduler=sched) == 1
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, want[k])
    assert opt.param_groups[0]["lr"] == want_lr and sched.last_epoch == 1
    assert torch.equal(torch.rand(3), rng_after_save)  # RNG restored


def test_lr_schedule() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=3, schedule="cosine", min_lr_ratio=0.1)
    assert [lr_factor(cfg, s, 13) for s in range(3)] == pytest.approx([0.25, 0.5, 0.75])
    assert lr_factor(cfg, 3, 13) == pytest.approx(1.0)
    assert lr_factor(cfg, 8, 13) == pytest.approx(0.55)
    assert lr_factor(cfg, 13, 13) == pytest.approx(0.1)
    assert lr_factor(OptimConfig(schedule="linear"), 5, 10) == pytest.approx(0.5)
    assert lr_factor(OptimConfig(), 100, None) == 1.0


def test_adamw_runs_fused_on_cpu_with_the_single_tensor_update() -> None:
    torch.manual_seed(0)
    fused_model = torch.nn.Linear(16, 8)
    loop_model = torch.nn.Linear(16, 8)
    loop_model.load_state_dict(fused_model.state_dict())
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    fused = build_optimizer(cfg, fused_model)
    loop = torch.optim.AdamW(loop_model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, foreach=False)  # fmt: skip
    assert fused.defaults["fused"] is True
    for _ in range(5):
        grads = [torch.randn_like(p) for p in fused_model.parameters()]
        for m, opt in ((fused_model, fused), (loop_model, loop)):
            for p, g in zip(m.parameters(), grads, strict=True):
                p.grad = g.clone()
            opt.step()
    for a, b in zip(fused_model.parameters(), loop_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _rank_batch(step: int = 0) -> RankBatch:
    b = make_batch(step, [[[10, 12], [9]], [[8, 8], [7], [6]]], vocab=1000)
    return RankBatch(
        step=step,
        rank=0,
        micro_batches=b.micro_batches[0],
        layout=[[22, 9], [16, 7, 6]],
        num_loss_tokens=b.num_loss_tokens,
        temperature=1.0,
        min_dispatch_version=0,
    )


def test_train_step_pads_and_updates(model) -> None:
    cfg = TrainerConfig(loss=MaskLossConfig(ratio_low=1e-6, ratio_high=1e6), optim=OptimConfig(lr=1e-2))
    opt = build_optimizer(cfg.optim, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    before = model.model.norm.weight.detach().clone()
    batch = _rank_batch()
    m = train_step(model, opt, sched, batch, cfg=cfg, loss_fn=build_loss_fn(cfg.loss), world_size=1)
    assert np.isfinite(m["loss/total"]) and m["optim/grad_norm"] > 0 and m["masked_fraction"] == 0
    assert not torch.equal(before, model.model.norm.weight)


def test_train_step_rejects_non_finite_and_bad_rows(model) -> None:
    cfg = TrainerConfig()
    opt = build_optimizer(cfg.optim, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    batch = _rank_batch()
    mb = batch.micro_batches[0]
    mb.sampler_logprobs = mb.sampler_logprobs.copy()
    mb.sampler_logprobs[int(np.nonzero(mb.loss_mask)[0][0])] = np.nan
    with pytest.raises(NonFiniteError):
        train_step(model, opt, sched, batch, cfg=cfg, loss_fn=build_loss_fn(cfg.loss), world_size=1)
    batch = _rank_batch()
    batch.micro_batches[0].loss_mask = batch.micro_batches[0].loss_mask.copy()
    batch.micro_batches[0].loss_mask[0] = True
    with pytest.raises(ValueError, match="first token"):
        train_step(model, opt, sched, batch, cfg=cfg, loss_fn=build_loss_fn(cfg.loss), world_size=1)
    with pytest.raises(ValueError, match="seq_len"):
        train_step(
            model,
            opt,
            sched,
            _rank_batch(),
            cfg=TrainerConfig(seq_len=16),
            loss_fn=build_loss_fn(cfg.loss),
            world_size=1,
        )


def test_staleness_defence_in_depth() -> None:
    batch = _rank_batch(step=5)
    batch.min_dispatch_version = 3
    check_staleness(batch, 2)
    check_staleness(batch, None)
    with pytest.raises(RuntimeError, match="staleness 2 > max_off_policy_steps=1"):
        check_staleness(batch, 1)
    batch.max_dispatch_version = 6  # a group generated by weights newer than this step: never trained
    with pytest.raises(RuntimeError, match="staleness -1 < 0"):
        check_staleness(batch, None)


@pytest.mark.slow
def test_resume_equals_uninterrupted(tiny_model_dir: Path, tmp_path: Path) -> None:
    """3 steps + checkpoint + fresh objects + 1 step == 4 steps straight (Adam moments, LR schedule, RNG)."""
    from transformers import AutoModelForCausalLM

    cfg = TrainerConfig(
        loss=MaskLossConfig(ratio_low=1e-6, ratio_high=1e6),
        optim=OptimConfig(lr=1e-2, warmup_steps=2, schedule="cosine"),
        max_steps=4,
    )

    def fresh():
        m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
        o = build_optimizer(cfg.optim, m)
        return m, o, torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr_factor(cfg.optim, s, cfg.max_steps))

    def step(m, o, s, n):
        return train_step(m, o, s, _rank_batch(n), cfg=cfg, loss_fn=build_loss_fn(cfg.loss), world_size=1)

    straight = fresh()
    losses = [step(*straight, n)["loss/total"] for n in range(4)]
    first = fresh()
    for n in range(3):
        step(*first, n)
    save_checkpoint(
        output_dir=tmp_path, step=3, model=first[0], optimizer=first[1], scheduler=first[2], keep=1
    )
    resumed = fresh()
    assert (
        load_checkpoint(
            latest_checkpoint(tmp_path), model=resumed[0], optimizer=resumed[1], scheduler=resumed[2]
        )
        == 3
    )
    assert step(*resumed, 3)["loss/total"] == pytest.approx(losses[3], rel=1e-6)
    for k, v in straight[0].state_dict().items():
        torch.testing.assert_close(resumed[0].state_dict()[k], v)
