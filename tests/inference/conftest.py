"""Fixtures of the inference conformance suite: one engine per session, started as a real process.

`target` is parametrized: `embedded` starts `python -m prime_async.entrypoints.inference @ inference.toml`
(the torch engine) on a free port; `sglang` (marker gpu) uses `PRIME_ASYNC_SGLANG_URL` +
`PRIME_ASYNC_SGLANG_MODEL` when set, else launches SGLang on the tiny model with our launcher (extra flags
from `PRIME_ASYNC_SGLANG_ARGS`).
Tests that change weights record the live weights in `target.current_weights`, so every test can
compare against an independent HF forward pass of exactly what the engine serves.

Every target states its dtype (never "auto", which is bfloat16 on CUDA): `embedded` and `embedded_moe` are
float32 and compare with HF float32 at 1e-4; `embedded_bf16` (the dense model) is bfloat16 and compares
with HF bfloat16 at `logprob_tolerance` (CPU supports bfloat16, so CI runs it too). The engine's device is
its default: CUDA when visible, so the same tests are the GPU check's conformance.

The bfloat16 tolerance, from bfloat16's rounding: 8 significant bits, unit roundoff u = 2^-8 ~ 3.9e-3. A
logprob is `z_t/T - logsumexp(z/T)` of logits z accumulated through the layers, each result rounded to
bfloat16; two bfloat16 computations (the engine's kernels, HF's) round independently, so they differ by
a few u relative to the logits: |dlogp| <= c * u * max(1, max|z|/T). Measured on the tiny dense model on
CPU (8 prompts x 64 sampled tokens, T = 1 and 0.7, max|z| ~ 1.9): engine bf16 vs HF bf16 up to 1.1e-2,
i.e. c = 1.1; HF bf16 vs HF fp32 8e-3 (c = 0.8). c = 4 leaves a margin of 3.6x, and stays far below what
a real defect costs (a wrong temperature, position or weight version moves logprobs by > 0.1). MoE is
checked in float32 only: in bfloat16 a near tie in the router picks another expert (3.3e-2 measured),
which no rounding bound covers.
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
BF16_UNIT_ROUNDOFF = 2.0**-8  # 8 significant bits
BF16_LOGPROB_C = 4.0  # measured c = 1.1 on CPU (module docstring): margin 3.6x
FP32_LOGPROB_TOL = 1e-4


def logprob_tolerance(dtype: str, logit_scale: float) -> float:
    """Largest |engine - HF| logprob accepted for an engine and an HF reference both in `dtype`, where
    `logit_scale` is max|logit| / temperature over the scored positions (module docstring)."""
    if dtype == "float32":
        return FP32_LOGPROB_TOL
    if dtype == "bfloat16":
        return BF16_LOGPROB_C * BF16_UNIT_ROUNDOFF * max(1.0, logit_scale)
    raise ValueError(f"no logprob tolerance for dtype {dtype!r}")


@dataclass
class Target:
    """An engine under test and what it currently serves."""

    kind: str
    base_url: str
    model_dir: Path
    current_weights: Path
    version: int = 0
    work_dir: Path = field(default_factory=Path)
    dtype: str = "float32"  # what the engine was started with (never "auto")

    def next_version(self) -> int:
        return self.version + 1


def _start_embedded(model_dir: Path, work: Path, dtype: str):
    config = (
        f'backend = "torch"\nseq_len = {TEST_SEQ_LEN}\noutput_dir = "{work}"\n[model]\npath = "{model_dir}"\n'
        f'dtype = "{dtype}"\n[engine]\nmax_running_requests = 64\nnum_threads = 1\n'
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
    scope="session",
    params=["embedded", "embedded_moe", "embedded_bf16", pytest.param("sglang", marks=pytest.mark.gpu)],
)
def target(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The engine under test: the embedded engine on the tiny dense model and on the tiny MoE model
    (routing in prefill and decode) in float32, on the dense model in bfloat16, or real SGLang (GPU,
    float32)."""
    work = tmp_path_factory.mktemp(f"engine_{request.param}")
    dtype = "bfloat16" if request.param == "embedded_bf16" else "float32"
    if request.param.startswith("embedded"):
        moe = request.param == "embedded_moe"
        model_dir = request.getfixturevalue("tiny_moe_model_dir") if moe else tiny_model_dir
        url, stop = _start_embedded(model_dir, work, dtype)
    else:
        url, model_dir, stop = _start_sglang(tiny_model_dir, work)
    version = int(httpx.get(f"{url}/model_info", timeout=10).json().get("weight_version") or 0)
    yield Target(request.param, url, model_dir, model_dir, version, work, dtype)
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


@dataclass
class Scored:
    """HF's logprobs of some tokens and the largest difference an engine in the same dtype may show."""

    logprobs: list[float]
    tol: float

    def max_error(self, engine_logprobs: list[float]) -> float:
        return max(abs(a - b) for a, b in zip(engine_logprobs, self.logprobs, strict=True))


class HFReference:
    """Independent HF forward pass (CPU): logprobs of `output` given `prompt` under the weights in a dir,
    in the dtype of the engine it checks."""

    def __init__(self) -> None:
        self._models: dict[tuple[Path, str], torch.nn.Module] = {}

    def model(self, path: Path, dtype: str = "float32"):
        from transformers import AutoModelForCausalLM

        if (path, dtype) not in self._models:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
            self._models[(path, dtype)] = model.eval()
        return self._models[(path, dtype)]

    @torch.no_grad()
    def score(
        self, path: Path, prompt: list[int], output: list[int], temperature: float = 1.0, *, dtype: str
    ) -> Scored:
        """Logprobs of `output` in `dtype`, and the tolerance for an engine in `dtype`."""
        ids = torch.tensor([prompt + output])
        logits = self.model(path, dtype)(ids).logits[0, len(prompt) - 1 : -1].float() / (temperature or 1.0)
        logp = torch.log_softmax(logits, dim=-1)
        tol = logprob_tolerance(dtype, float(logits.abs().max()))
        return Scored(logp.gather(-1, torch.tensor(output)[:, None])[:, 0].tolist(), tol)


@pytest.fixture(scope="session")
def hf_ref() -> HFReference:
    torch.set_num_threads(1)
    return HFReference()
