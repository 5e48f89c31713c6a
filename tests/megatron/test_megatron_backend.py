"""Megatron backend vs HF / the FSDP backend on the tiny models (CPU, gloo, shimmed workers).

Each torchrun run of `worker.py` (world size 1, and TP=2 under sequence parallelism) builds the backend on
the tiny Qwen3 model plus two extra families (Llama with untied embeddings and llama3 RoPE scaling; Qwen2
with qkv bias and a vocabulary that needs padding), writes logits, exported weights before/after one
train step, and the step's metrics. The comparisons happen here, in a process without the shim:
- logits of every packed row equal the HF model's per-sample logits within 1e-4;
- the exported weights equal the loaded safetensors exactly;
- one train step on the same micro-batches gives the same loss, grad norm and updated weights as the FSDP
  backend's `train_step` (world size 1), also with data parallel = 2 (each replica trains half the
  micro-batches; megatron's DDP must sum their gradients, not average them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the `megatron` extra")

from megatron_batches import make_micro_batches, num_loss_tokens
from safetensors.torch import load_file

from prime_async.transport.types import MicroBatch

WORKER = Path(__file__).with_name("worker.py")
TEMPERATURE, LR = 0.9, 1e-3  # same as worker.py


def _save_random_model(out: Path, config) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    # HF inits norms to 1: perturb them so a swapped norm mapping cannot go unnoticed.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def extra_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    llama = LlamaConfig(
        vocab_size=512,
        tie_word_embeddings=False,
        head_dim=16,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        **common,
    )
    llama.architectures = ["LlamaForCausalLM"]
    qwen2 = Qwen2Config(vocab_size=500, tie_word_embeddings=True, **common)
    qwen2.architectures = ["Qwen2ForCausalLM"]
    root = tmp_path_factory.mktemp("megatron_models")
    return [_save_random_model(root / "llama", llama), _save_random_model(root / "qwen2", qwen2)]


def worker_command(
    out: Path,
    model_dir: Path,
    extra: list[Path],
    *,
    nproc: int,
    tp: int,
    device: str = "cpu",
    steps_per_batch: int = 1,
    ep: int = 1,
) -> tuple[list[str], dict[str, str]]:
    """torchrun command and environment of `worker.py`. A CPU run hides CUDA from the worker (its ranks are
    CPU ranks over gloo even on a GPU machine, and compare at fp32 CPU tolerances); a CUDA run is told so."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(WORKER),
        "--model-dir",
        str(model_dir),
        "--tp",
        str(tp),
        "--out",
        str(out),
        "--steps-per-batch",
        str(steps_per_batch),
        "--ep",
        str(ep),
        "--device",
        device,
    ]
    for d in extra:
        cmd += ["--extra-model-dir", str(d)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return cmd, env


def _run_worker(out: Path, model_dir: Path, extra: list[Path], **kwargs) -> Path:
    cmd, env = worker_command(out, model_dir, extra, **kwargs)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out


def test_worker_runs_on_the_device_it_is_given(tmp_path: Path) -> None:
    """A CPU run hides CUDA (it ran its CPU ranks beside a CUDA model on the first GPU machine: `--device`
    was never passed); a CUDA run passes `--device cuda` and leaves the visible devices alone."""
    cmd, env = worker_command(tmp_path, tmp_path, [], nproc=1, tp=1)
    assert cmd[cmd.index("--device") + 1] == "cpu" and env["CUDA_VISIBLE_DEVICES"] == ""
    cmd, env = worker_command(tmp_path, tmp_path, [], nproc=1, tp=1, device="cuda")
    assert cmd[cmd.index("--device") + 1] == "cuda"
    assert env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture(scope="module")
def ws1_run(tiny_model_dir: Path, extra_model_dirs: list[Path], tmp_path_factory) -> Path:
    return _run_worker(tmp_path_factory.mktemp("ws1"), tiny_model_dir, extra_model_dirs, nproc=1, tp=1)


@pytest.fixture(scope="module")
def dp2_run(tiny_model_dir: Path, tmp_path_factory) -> Path:
    return _run_worker(tmp_path_factory.mktemp("dp2"), tiny_model_dir, [], nproc=2, tp=1)


@pytest.fixture(scope="module")
def dp2_two_steps_run(tiny_model_dir: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dp2_two_steps")
    return _run_worker(out, tiny_model_dir, [], nproc=2, tp=1, steps_per_batch=2)


@pytest.fixture(scope="module")
def tp2_run(tiny_model_dir: Path, extra_model_dirs: list[Path], tmp_path_factory) -> Path:
    return _run_worker(tmp_path_factory.mktemp("tp2"), tiny_model_dir, extra_model_dirs, nproc=2, tp=2)


@pytest.fixture(scope="module")
def moe_ep2_run(tiny_moe_model_dir: Path, tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE model at expert parallel 2 (two CPU ranks, 2 experts each, data parallel 2)."""
    return _run_worker(tmp_path_factory.mktemp("moe_ep2"), tiny_moe_model_dir, [], nproc=2, tp=1, ep=2)


@torch.no_grad()
def _hf_packed_logits(model_dir: Path, mbs: list[MicroBatch]) -> list[torch.Tensor]:
    """HF logits of every packed row, computed sample by sample (the reference for packing too)."""
    from transformers import AutoModelForCausalLM

    from prime_async.trainer.megatron.batch import sample_bounds

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    for mb in mbs:
        ids = torch.from_numpy(mb.input_ids.astype("int64"))
        parts, block = [], 0
        for s, e in sample_bounds(mb.position_ids):
            shared = int(mb.position_ids[s])  # a branch runs after the shared tokens of its block
            block = s if shared == 0 else block
            whole = torch.cat([ids[block : block + shared], ids[s:e]])
            parts.append(model(input_ids=whole[None]).logits[0, shared:])
        rows.append(torch.cat(parts))
    return rows


def _check_logits(run: Path, tiny_model_dir: Path, extra_model_dirs: list[Path]) -> None:
    logits = torch.load(run / "logits.pt")
    dirs = {"main": tiny_model_dir, **{f"extra{i}": d for i, d in enumerate(extra_model_dirs)}}
    for key, model_dir in dirs.items():
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        ref = _hf_packed_logits(model_dir, make_micro_batches(vocab))
        for row, (got, want) in enumerate(zip(logits[key], ref, strict=True)):
            assert got.shape == want.shape, (key, row)
            err = (got - want).abs().max().item()
            assert err < 1e-4, f"{model_dir.name} row {row}: max |logit diff| {err:.2e}"


def _check_export(run: Path, tiny_model_dir: Path) -> None:
    exported = torch.load(run / "initial.pt")
    loaded = load_file(tiny_model_dir / "model.safetensors")
    assert sorted(exported) == sorted(loaded)
    for name, tensor in loaded.items():
        assert torch.equal(exported[name], tensor), name


def _fsdp_step(tiny_model_dir: Path, steps_per_batch: int):
    """One batch of the FSDP backend's `train_step` (world size 1) on the worker's micro-batches."""
    from prime_async.config.shared import ModelConfig
    from prime_async.config.trainer import OptimConfig, TrainerConfig
    from prime_async.trainer.fsdp import load_model, train_step
    from prime_async.trainer.loss import build_loss_fn
    from prime_async.trainer.optim import build_optimizer, lr_factor
    from prime_async.transport.zmq_batches import RankBatch

    torch.set_num_threads(1)
    cfg = TrainerConfig(
        model=ModelConfig(path=str(tiny_model_dir), dtype="float32"),
        optim=OptimConfig(lr=LR, num_steps_per_batch=steps_per_batch),
    )
    model = load_model(cfg, torch.device("cpu"))
    optimizer = build_optimizer(cfg.optim, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg.optim, s, cfg.max_steps))
    mbs = make_micro_batches(model.config.vocab_size)
    batch = RankBatch(
        step=0,
        rank=0,
        micro_batches=mbs,
        layout=[[mb.num_tokens for mb in mbs]],
        num_loss_tokens=num_loss_tokens(mbs),
        temperature=TEMPERATURE,
        min_dispatch_version=0,
    )
    metrics = train_step(
        model, optimizer, scheduler, batch, cfg=cfg, loss_fn=build_loss_fn(cfg.loss), world_size=1
    )
    from prime_async.models.moe_layout import split_experts  # MoE: checkpoint names, as megatron exports

    return metrics, {k: v.detach().clone() for k, v in split_experts(model.state_dict()).items()}


@pytest.fixture(scope="module")
def fsdp_reference(tiny_model_dir: Path) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    return _fsdp_step(tiny_model_dir, 1)


@pytest.fixture(scope="module")
def fsdp_two_steps_reference(tiny_model_dir: Path) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    return _fsdp_step(tiny_model_dir, 2)


def _check_train_step(run: Path, fsdp_reference, steps: int = 1) -> None:
    ref_metrics, ref_weights = fsdp_reference
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["loss/total"] == pytest.approx(ref_metrics["loss/total"], rel=1e-5, abs=1e-6)
    assert metrics["optim/grad_norm"] == pytest.approx(ref_metrics["optim/grad_norm"], rel=1e-4)
    keys = ("mismatch_kl", "ratio/mean", "masked_fraction", "entropy", "optim/num_steps")
    for key in (*keys, "offpolicy/effective_steps/mean", "offpolicy/effective_steps/max"):
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-7), key
    after = torch.load(run / "after.pt")
    initial = torch.load(run / "initial.pt")
    assert sorted(after) == sorted(k for k in ref_weights if k != "lm_head.weight")
    moved = 0.0
    for name, tensor in after.items():
        diff = (tensor - ref_weights[name]).abs()
        # Adam's first step is ~lr * sign(grad): a wrong gradient flips signs (error ~2 * lr = 2e-3). Where
        # |grad| ~ eps (the update is well below lr) it follows the gradient's float noise instead (the two
        # backends sum the logits' gradient in different orders), so those elements are only bounded by lr.
        # After `steps` Adam steps an element carries signal when every step moved it the same way (~lr each).
        signal = (ref_weights[name] - initial[name]).abs() > (steps - 0.5) * LR
        err = diff[signal].max().item() if signal.any() else 0.0
        assert err < 1e-4, f"{name}: updated weight differs from the FSDP step by {err:.2e}"
        assert diff.max().item() < steps * LR, f"{name}: a near-zero gradient moved a weight by more than lr"
        moved = max(moved, (tensor - initial[name]).abs().max().item())
    assert moved > 1e-4, "the step did not change the weights"


@pytest.mark.slow
def test_logits_match_hf_world_size_1(ws1_run, tiny_model_dir, extra_model_dirs) -> None:
    _check_logits(ws1_run, tiny_model_dir, extra_model_dirs)


@pytest.mark.slow
def test_exported_weights_equal_loaded_world_size_1(ws1_run, tiny_model_dir) -> None:
    _check_export(ws1_run, tiny_model_dir)


@pytest.mark.slow
def test_train_step_matches_fsdp_world_size_1(ws1_run, fsdp_reference) -> None:
    _check_train_step(ws1_run, fsdp_reference)


@pytest.mark.slow
def test_logits_match_hf_tp2(tp2_run, tiny_model_dir, extra_model_dirs) -> None:
    _check_logits(tp2_run, tiny_model_dir, extra_model_dirs)


@pytest.mark.slow
def test_exported_weights_equal_loaded_tp2(tp2_run, tiny_model_dir) -> None:
    _check_export(tp2_run, tiny_model_dir)


@pytest.mark.slow
def test_train_step_matches_fsdp_tp2(tp2_run, fsdp_reference) -> None:
    _check_train_step(tp2_run, fsdp_reference)


@pytest.mark.slow
def test_train_step_matches_fsdp_dp2(dp2_run, fsdp_reference) -> None:
    """Regression: `calculate_per_token_loss` was set after megatron's DDP read it, so DP = 2 averaged
    gradients (grad norm half the FSDP one)."""
    _check_train_step(dp2_run, fsdp_reference)


@pytest.mark.slow
def test_two_steps_per_batch_match_fsdp_dp2(dp2_two_steps_run, fsdp_two_steps_reference) -> None:
    """`optim.num_steps_per_batch = 2` with two replicas: each replica's rows [r0, r2] / [r1, r3] split
    into mini-batches {r0, r1} and {r2, r3} (the FSDP process's [r0, r1], [r2, r3]), each normalized by
    its loss tokens summed over the data-parallel group; two optimizer steps, the second one's tokens
    one step further off-policy."""
    _check_train_step(dp2_two_steps_run, fsdp_two_steps_reference, steps=2)
    metrics = json.loads((dp2_two_steps_run / "metrics.json").read_text())
    assert metrics["optim/num_steps"] == 2 and metrics["offpolicy/effective_steps/max"] == 1


@pytest.fixture(scope="module")
def fsdp_moe_reference(tiny_moe_model_dir: Path) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    return _fsdp_step(tiny_moe_model_dir, 1)


@pytest.mark.slow
def test_moe_expert_parallel_2_matches_hf_and_fsdp(
    moe_ep2_run, tiny_moe_model_dir, fsdp_moe_reference
) -> None:
    """MoE on megatron with experts split over two ranks: the same logits as HF, the same weights out,
    and the same train step as the fsdp backend on the same micro-batches."""
    _check_logits(moe_ep2_run, tiny_moe_model_dir, [])
    _check_export(moe_ep2_run, tiny_moe_model_dir)
    _check_train_step(moe_ep2_run, fsdp_moe_reference)
