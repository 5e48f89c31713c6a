"""scripts/bench_engine.py's accuracy check and decode-step timing feed the model on its device.

On the first GPU run `--device cuda` crashed in `max_logprob_error` (CPU ids into the CUDA model). Here
the same functions run on CPU against a real engine (the figure they report is checked), and against a
model on the meta device with a spy on its forward (`tests/device_spy.py`): an input left on the CPU fails.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from device_spy import InputsOnDevice, spy_inputs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_engine", REPO / "scripts" / "bench_engine.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_engine"] = module
    spec.loader.exec_module(module)
    return module


def test_accuracy_check_feeds_the_model_device(bench, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).to("meta")
    calls = spy_inputs(model, stop=True)
    round_ = ([[5, 6, 7]], [SimpleNamespace(output_ids=[8, 9], logprobs=[-1.0, -1.0])])
    with pytest.raises(InputsOnDevice):
        bench.max_logprob_error(model, round_)
    assert calls == [{"arg0": torch.device("meta")}]


def test_accuracy_check_and_decode_step_on_a_real_engine(bench, tiny_model_dir: Path) -> None:
    from prime_async.inference.engine import Engine
    from prime_async.inference.engine_settings import EngineSettings, SlotSettings

    torch.set_num_threads(1)
    engine = Engine(
        EngineSettings(
            model_path=str(tiny_model_dir),
            dtype="float32",
            device="cpu",
            kernels="dense",
            slots=SlotSettings(max_len=64),
        )
    )
    engine.start()
    try:
        _, round_ = asyncio.run(bench._engine_round(engine, 2, 4, 8, engine.vocab_size))
        assert bench.max_logprob_error(engine.runner.model, round_) < 1e-4
        seconds, matmul_share = bench.decode_step_time(engine, 2, 8)
        assert seconds > 0 and 0 <= matmul_share <= 1
    finally:
        engine.stop()


def test_decode_steps_side_by_side(bench, tiny_model_dir: Path, monkeypatch) -> None:
    """`--decode-steps eager auto` builds one engine per path, named KERNELS-STEP (auto: static on CPU), and
    the decode-step timing runs each engine's own path (the static one through its StaticDecoder)."""
    torch.set_num_threads(1)
    argv = "bench_engine --batches 2 --kernels dense --decode-steps eager auto --dtype float32 --new-tokens 8"
    monkeypatch.setattr(sys, "argv", argv.split())
    args = bench.parse_args()
    engines = bench.build_engines(tiny_model_dir, args)
    try:
        assert list(engines) == ["dense-eager", "dense-static"]
        assert engines["dense-eager"].runner.static is None
        static = engines["dense-static"].runner.static
        calls: list[int] = []
        engines["dense-static"].runner.static = lambda ids, pos: calls.append(len(ids)) or static(ids, pos)
        for engine in engines.values():
            seconds, _ = bench.decode_step_time(engine, 2, 8)
            assert seconds > 0
        assert calls and set(calls) == {2}
    finally:
        for engine in engines.values():
            engine.stop()
