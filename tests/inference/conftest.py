"""Fixtures of the inference conformance suite: one engine per session, started as a real process.

`target` is parametrized: `embedded` starts `python -m prime_async.entrypoints.inference @ inference.toml`
(the torch engine) on a free port; `sglang` (marker gpu) uses `PRIME_ASYNC_SGLANG_URL` +
`PRIME_ASYNC_SGLANG_MODEL` when set, else launches SGLang on the tiny model with our launcher (extra flags
from `PRIME_ASYNC_SGLANG_ARGS`).
Tests that change weights record the live weights in `target.current_weights`, so every test can
compare against an independent HF forward pass of exactly what the engine serves.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch

from proc_helpers import free_port, start_embedded_engine

TEST_SEQ_LEN = 4096


@dataclass
class Target:
    """An engine under test and what it currently serves."""

    kind: str
    base_url: str
    model_dir: Path
    current_weights: Path
    version: int = 0
    work_dir: Path = field(default_factory=Path)

    def next_version(self) -> int:
        return self.version + 1


def _start_embedded(model_dir: Path, work: Path):
    config = (
        f'backend = "torch"\nseq_len = {TEST_SEQ_LEN}\noutput_dir = "{work}"\n[model]\npath = "{model_dir}"\n'
        "[engine]\nmax_running_requests = 64\nnum_threads = 1\n"
    )
    url, proc = start_embedded_engine(config, work, timeout_s=300)
    return url, lambda: (proc.terminate(), proc.wait(30))


def _start_sglang(model_dir: Path, work: Path):
    if os.environ.get("PRIME_ASYNC_SGLANG_URL"):
        model = Path(os.environ["PRIME_ASYNC_SGLANG_MODEL"])
        return os.environ["PRIME_ASYNC_SGLANG_URL"].rstrip("/"), model, lambda: None
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang not installed (uv sync --extra sglang)")
    from prime_async.config.inference import InferenceConfig
    from prime_async.inference.sglang_launcher import SGLangLauncher, build_launch_specs

    extra = shlex.split(os.environ.get("PRIME_ASYNC_SGLANG_ARGS", "--attention-backend torch_native"))
    cfg = InferenceConfig.model_validate(
        {
            "backend": "sglang",
            "seq_len": TEST_SEQ_LEN,
            "model": {"path": str(model_dir), "dtype": "float32"},
            "server": {"port": free_port()},
            "sglang": {"python": sys.executable, "mem_fraction": 0.3, "extra_args": extra},
        }
    )
    launcher = SGLangLauncher(specs=build_launch_specs(cfg), startup_timeout_s=600)
    launcher.start()
    try:
        launcher.wait_ready()
    except Exception:
        launcher.stop()
        raise
    return launcher.urls[0], model_dir, launcher.stop


@pytest.fixture(
    scope="session", params=["embedded", "embedded_moe", pytest.param("sglang", marks=pytest.mark.gpu)]
)
def target(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The engine under test: the embedded engine on the tiny dense model and on the tiny MoE model
    (routing in prefill and decode), or real SGLang (GPU)."""
    work = tmp_path_factory.mktemp(f"engine_{request.param}")
    if request.param.startswith("embedded"):
        moe = request.param == "embedded_moe"
        model_dir = request.getfixturevalue("tiny_moe_model_dir") if moe else tiny_model_dir
        url, stop = _start_embedded(model_dir, work)
    else:
        url, model_dir, stop = _start_sglang(tiny_model_dir, work)
    version = int(httpx.get(f"{url}/model_info", timeout=10).json().get("weight_version") or 0)
    yield Target(request.param, url, model_dir, model_dir, version, work)
    stop()


# ---- weights ---------------------------------------------------------------------------------------
def _copy_meta(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)


def _write_weights(src: Path, dst: Path, *, noise: float = 0.0, seed: int = 0, drop: str | None = None,
                  reshape: str | None = None) -> Path:  # fmt: skip
    """Copy the HF dir `src` to `dst` with perturbed / missing / mis-shaped tensors."""
    from safetensors.torch import load_file, save_file

    _copy_meta(src, dst)
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    gen = torch.Generator().manual_seed(seed)
    for name in sorted(state):
        t = state[name]
        if noise:
            t = t + noise * torch.randn(t.shape, generator=gen, dtype=t.dtype)
        if name == reshape:
            t = torch.zeros(t.shape[0] + 1, *t.shape[1:], dtype=t.dtype)
        state[name] = t.contiguous()
    if drop is not None:
        del state[drop]
    save_file(state, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="session")
def write_weights():
    """`write_weights(src, dst, noise=, seed=, drop=, reshape=)`: a weight directory to load."""
    return _write_weights


class HFReference:
    """Independent HF forward pass: logprobs of `output` given `prompt` under the weights in a dir."""

    def __init__(self) -> None:
        self._models: dict[Path, torch.nn.Module] = {}

    def model(self, path: Path):
        from transformers import AutoModelForCausalLM

        if path not in self._models:
            self._models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return self._models[path]

    @torch.no_grad()
    def logprobs(
        self, path: Path, prompt: list[int], output: list[int], temperature: float = 1.0
    ) -> list[float]:
        ids = torch.tensor([prompt + output])
        logits = self.model(path)(ids).logits[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        return logp.gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


@pytest.fixture(scope="session")
def hf_ref() -> HFReference:
    torch.set_num_threads(1)
    return HFReference()
