"""LoRA on the FSDP backend: only adapters train, broadcasts hold a PEFT adapter, checkpoints round-trip
adapter + optimizer, config refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from prime_async.config.shared import LoraConfig
from prime_async.config.trainer import MaskLossConfig, OptimConfig, TrainerConfig
from prime_async.testing.synthetic import make_batch
from prime_async.trainer.fsdp import FsdpBackend
from prime_async.transport.zmq_batches import RankBatch
from prime_async.weights.writer import BroadcastWriter


def _rank_batch(step: int) -> RankBatch:
    b = make_batch(step, [[[10, 12], [9]]], vocab=1000)
    return RankBatch(
        step=step, rank=0, micro_batches=b.micro_batches[0], layout=[[22, 9]],
        num_loss_tokens=b.num_loss_tokens, temperature=1.0, min_dispatch_version=max(0, step - 1),
    )  # fmt: skip


def _cfg(model_dir: Path, out: Path, **lora) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "output_dir": str(out),
            "lora": {"rank": 4, "alpha": 8.0, **lora},
            "loss": MaskLossConfig(ratio_low=1e-6, ratio_high=1e6).model_dump(),
            "optim": OptimConfig(lr=1e-2).model_dump(),
            "ckpt": {"interval": 1},
        }
    )


def _backend(cfg: TrainerConfig) -> FsdpBackend:
    torch.set_num_threads(1)
    return FsdpBackend(cfg, torch.device("cpu"), 1)


def test_only_adapters_train(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend = _backend(_cfg(tiny_model_dir, tmp_path, target_modules=["q_proj", "v_proj", "down_proj"]))
    named = dict(backend.model.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj", "down_proj"}
    optimized = {id(p) for g in backend.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(named[n]) for n in trainable}  # base weights have no optimizer state
    frozen = {n: p.detach().clone() for n, p in named.items() if not p.requires_grad}
    lora_b = {n: p.detach().clone() for n, p in named.items() if ".lora_B." in n}
    assert all(torch.count_nonzero(v) == 0 for v in lora_b.values())  # PEFT starts B at zero
    for step in range(2):
        metrics = backend.train_rank_batch(_rank_batch(step))
        assert metrics["optim/grad_norm"] > 0
    for n, v in frozen.items():
        assert torch.equal(named[n], v), f"frozen {n} changed"
    assert all(torch.count_nonzero(named[n]) > 0 for n in lora_b)


def test_adapter_broadcast_loads_with_peft(tiny_model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    backend = _backend(_cfg(tiny_model_dir, tmp_path))
    backend.train_rank_batch(_rank_batch(0))
    pub = BroadcastWriter(
        output_dir=tmp_path, model_config=backend.pretrained_config(), source_dir=tiny_model_dir, keep_last=2
    )
    config, tensors = backend.lora_adapter()
    path = pub.publish_adapter(config, tensors, 1)
    assert sorted(p.name for p in path.iterdir()) == [
        "STABLE",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    meta = json.loads((path / "adapter_config.json").read_text())
    assert meta["r"] == 4 and meta["lora_alpha"] == 8.0 and meta["peft_type"] == "LORA"
    saved = load_file(str(path / "adapter_model.safetensors"))
    assert set(saved) == set(tensors) and all(k.startswith("base_model.model.") for k in saved)
    full = sum(p.numel() for n, p in backend.model.named_parameters() if not p.requires_grad)
    assert sum(t.numel() for t in saved.values()) < full / 5  # only the adapter travels
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(path)).eval()
    ids = torch.arange(3, 40)[None]
    backend.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, backend.model(input_ids=ids).logits)


def test_checkpoint_resume_restores_adapter_and_optimizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = _cfg(tiny_model_dir, tmp_path)
    a = _backend(cfg)
    a.train_rank_batch(_rank_batch(0))
    a.save_checkpoint(output_dir=tmp_path, step=1, keep=2)
    state = torch.load(tmp_path / "checkpoints/trainer/step_1/trainer.pt", weights_only=True)
    assert state["model"] and all(".lora_" in k for k in state["model"])  # adapter only, no base copy
    b = _backend(cfg)
    assert b.load_checkpoint(tmp_path / "checkpoints/trainer/step_1") == 1
    for step in (1, 2):  # same optimizer moments: the next steps match exactly
        ma, mb = a.train_rank_batch(_rank_batch(step)), b.train_rank_batch(_rank_batch(step))
        assert ma["loss/total"] == pytest.approx(mb["loss/total"], rel=1e-6)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=n)
    full = FsdpBackend(TrainerConfig(model={"path": str(tiny_model_dir)}), torch.device("cpu"), 1)
    with pytest.raises(ValueError, match="LoRA adapter-only but this trainer is full-weight"):
        full.load_checkpoint(tmp_path / "checkpoints/trainer/step_1")


def test_lora_config_refusals(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"not found|no trainable"):
        _backend(_cfg(tiny_model_dir, tmp_path, target_modules=["no_such_proj"]))
    with pytest.raises(ValueError, match="module name pattern"):
        LoraConfig(target_modules=[".q_proj"])
    with pytest.raises(
        ValueError, match=r"lora with trainer.backend = .megatron.: megatron-core 0.16 has no adapter"
    ):
        TrainerConfig.model_validate(
            {"backend": "megatron", "lora": {}, "model": {"path": str(tiny_model_dir)}}
        )


def test_merged_export_loads_in_transformers(tiny_model_dir: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    backend = _backend(_cfg(tiny_model_dir, tmp_path))
    backend.train_rank_batch(_rank_batch(0))
    pub = BroadcastWriter(
        output_dir=tmp_path, model_config=backend.pretrained_config(), source_dir=tiny_model_dir, keep_last=2
    )
    adapter = pub.publish_adapter(*backend.lora_adapter(), 1)
    out = tmp_path / "merged"
    cmd = [
        sys.executable,
        "-m",
        "prime_async.entrypoints.export_lora",
        "--adapter",
        str(adapter),
        "--output",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not any("lora" in k for k in load_file(str(out / "model.safetensors")))
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    AutoTokenizer.from_pretrained(out)
    ids = torch.arange(3, 40)[None]
    backend.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, backend.model(input_ids=ids).logits)
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "exists and is not empty" in again.stderr
