"""LoRA on the embedded engine, over HTTP against a real engine process: SGLang's routes and payloads,
per-request adapters, logprobs equal to the trainer's merged forward."""

from __future__ import annotations

import asyncio
import functools
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

import zygote
from prime_async.config.trainer import MaskLossConfig, TrainerConfig
from prime_async.testing.synthetic import make_batch
from prime_async.trainer.fsdp import FsdpBackend
from prime_async.transport.zmq_batches import RankBatch
from prime_async.weights.writer import BroadcastWriter
from proc_helpers import free_port, wait_healthy

LORA = {"rank": 4, "alpha": 16.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"]}  # fmt: skip


def _train_adapters(model_dir: Path, out: Path, versions: int) -> tuple[FsdpBackend, list[Path]]:
    """Train a few steps at a large LR (so the adapter moves the logprobs) and publish each version."""
    torch.set_num_threads(1)
    cfg = TrainerConfig.model_validate(
        {"model": {"path": str(model_dir)}, "output_dir": str(out), "lora": LORA,
         "loss": MaskLossConfig(ratio_low=1e-6, ratio_high=1e6).model_dump(), "optim": {"lr": 5e-2}}
    )  # fmt: skip
    backend = FsdpBackend(cfg, torch.device("cpu"), 1)
    pub = BroadcastWriter(output_dir=out, model_config=backend.pretrained_config(), source_dir=model_dir,
                          keep_last=versions + 1)  # fmt: skip
    paths = []
    for step in range(versions):
        b = make_batch(step, [[[30, 20]]], vocab=1000)
        rb = RankBatch(
            step=step, rank=0, micro_batches=b.micro_batches[0], layout=[[50]],
            num_loss_tokens=b.num_loss_tokens, temperature=1.0, min_dispatch_version=step,
        )  # fmt: skip
        backend.train_rank_batch(rb)
        config, tensors = backend.lora_adapter()
        paths.append(pub.publish_adapter(config, tensors, step + 1))
    return backend, paths


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("lora_engine")
    backend, paths = _train_adapters(tiny_model_dir, work, versions=2)
    port = free_port()
    cfg = work / "inference.toml"
    cfg.write_text(
        f'backend = "torch"\nseq_len = 512\noutput_dir = "{work}"\nmax_loaded_loras = 2\n'
        f'[model]\npath = "{tiny_model_dir}"\ndtype = "float32"\n[server]\nport = {port}\n'
        f"[engine]\nmax_running_requests = 8\nnum_threads = 1\n[lora]\nrank = 4\n"
    )
    log = work / "engine.log"
    with log.open("w") as fh:
        proc = zygote.popen([sys.executable, "-m", "prime_async.entrypoints.inference", "@", str(cfg)],
                                stdout=fh, stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log, timeout_s=300)
        yield url, backend, paths, work
    finally:
        proc.terminate()
        proc.wait(30)


@functools.cache
def _merged(model_dir: Path, adapter: Path | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return model.eval()


def _merged_logprobs(model_dir: Path, adapter: Path | None, prompt: list[int], out: list[int]) -> list[float]:
    """Log-softmax of the output tokens under the merged model (base + adapter folded into W)."""
    model = _merged(model_dir, adapter)
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(out)]


async def _generate(client: httpx.AsyncClient, prompt: list[int], lora: str | None, seed: int) -> dict:
    sampling = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": seed}
    body = {"input_ids": prompt, "return_logprob": True, "sampling_params": sampling}
    if lora is not None:
        body["lora_path"] = lora
    resp = await client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_adapter_logprobs_equal_merged_forward(lora_engine, tiny_model_dir: Path) -> None:
    url, _, paths, _ = lora_engine
    load = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "v1", "lora_path": str(paths[0])})
    assert load.status_code == 200 and load.json()["success"], load.text
    assert load.json()["loaded_adapters"] == {"v1": str(paths[0])}
    prompts = [[5, 17, 99, 3, 42, 7], [11, 12, 13], [200, 201, 202, 203, 204]]

    async def batch() -> list[dict]:  # adapter and base requests decode in one batch
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            jobs = [_generate(c, p, "v1", i) for i, p in enumerate(prompts)]
            jobs += [_generate(c, p, None, 10 + i) for i, p in enumerate(prompts)]
            return await asyncio.gather(*jobs)

    answers = asyncio.run(batch())
    worst, moved = 0.0, 0.0
    for k, ans in enumerate(answers):
        prompt, adapter = prompts[k % 3], (paths[0] if k < 3 else None)
        out = ans["output_ids"]
        got = [lp for lp, _, _ in ans["meta_info"]["output_token_logprobs"]]
        want = _merged_logprobs(tiny_model_dir, adapter, prompt, out)
        worst = max(worst, max(abs(a - b) for a, b in zip(got, want, strict=True)))
        if adapter is not None:
            base = _merged_logprobs(tiny_model_dir, None, prompt, out)
            moved = max(moved, max(abs(a - b) for a, b in zip(want, base, strict=True)))
    assert worst < 1e-4, f"engine vs merged forward: max |logprob diff| {worst}"
    assert moved > 1e-2, "the adapter barely changes the model: the test would not tell adapters apart"


def test_lora_routes_follow_sglang(lora_engine) -> None:
    url, _, paths, work = lora_engine
    post = lambda route, body: httpx.post(f"{url}{route}", json=body, timeout=60)  # noqa: E731
    if "v1" not in post("/unload_lora_adapter", {"lora_name": "nope"}).json()["loaded_adapters"]:
        assert post("/load_lora_adapter", {"lora_name": "v1", "lora_path": str(paths[0])}).json()["success"]
    again = post("/load_lora_adapter", {"lora_name": "v1", "lora_path": str(paths[0])})
    assert again.status_code == 400 and "already loaded" in again.json()["error_message"]
    bad = work / "bad_adapter"
    shutil.copytree(paths[1], bad)
    (bad / "adapter_model.safetensors").write_bytes(b"garbage")
    refused = post("/load_lora_adapter", {"lora_name": "bad", "lora_path": str(bad)})
    assert refused.status_code == 400 and "unreadable adapter weights" in refused.json()["error_message"]
    assert post("/load_lora_adapter", {"lora_name": "v2", "lora_path": str(paths[1])}).json()["success"]
    full = post("/load_lora_adapter", {"lora_name": "v3", "lora_path": str(paths[1])})
    assert full.status_code == 400 and "max_loaded_loras" in full.json()["error_message"]
    unknown = post("/generate", {"input_ids": [1, 2], "lora_path": "v9"})
    assert unknown.status_code == 400 and "not loaded: v9" in unknown.text
    gone = post("/unload_lora_adapter", {"lora_name": "v1"})
    assert gone.status_code == 200 and gone.json()["loaded_adapters"] == {"v2": str(paths[1])}
    assert post("/generate", {"input_ids": [1, 2], "lora_path": "v1"}).status_code == 400
    relabel = post("/update_weight_version", {"new_version": "2", "abort_all_requests": False})
    assert relabel.json() == {"success": True, "message": "Weight version updated to 2", "new_version": "2"}
    ans = post(
        "/generate", {"input_ids": [1, 2], "lora_path": "v2", "sampling_params": {"max_new_tokens": 2}}
    )
    assert ans.json()["meta_info"]["weight_version"] == "2"
    assert post("/unload_lora_adapter", {"lora_name": "v2"}).json()["loaded_adapters"] == {}


def test_sglang_launch_flags_for_lora() -> None:
    from prime_async.config.inference import InferenceConfig
    from prime_async.inference.sglang_launcher import build_launch_specs

    cfg = InferenceConfig.model_validate(
        {"backend": "sglang", "model": {"path": "/m"}, "max_loaded_loras": 3,
         "lora": {"rank": 16, "target_modules": ["self_attn.q_proj", "v_proj"]}}
    )  # fmt: skip
    argv = build_launch_specs(cfg)[0].argv
    i = argv.index("--enable-lora")
    assert argv[i:] == [
        "--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "q_proj", "v_proj",
        "--max-loaded-loras", "3", "--max-loras-per-batch", "3",
    ]  # fmt: skip
    plain = InferenceConfig.model_validate({"backend": "sglang", "model": {"path": "/m"}})
    assert not any("lora" in a for a in build_launch_specs(plain)[0].argv)
