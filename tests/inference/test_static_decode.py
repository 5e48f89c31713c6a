"""The embedded engine's static decode step (`inference/static_decode.py`) on CPU.

The static step pads a decode step to a batch bucket and a power-of-two KV span so that CUDA can capture it
as a graph. Here it runs uncaptured, and under `RecordingCapture`: a stand-in for CUDA graphs that records
which storages the step reads at capture and checks, at every replay, that it reads exactly those (a real
graph replays fixed addresses: a weight rebound instead of copied in place, or an input not copied into the
static buffer, would be silently stale on a GPU). Compared with the eager step (`decode_step = "eager"`,
the decode before this change) at fp32: same tokens, logprobs within 1e-5.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from prime_async.config.inference import InferenceConfig
from prime_async.inference.engine import Engine, RequestOutput
from prime_async.inference.engine_settings import EngineSettings, SlotSettings
from prime_async.inference.model_runner import ModelRunner
from prime_async.inference.sampler import SamplingParams
from prime_async.inference.static_decode import (
    StaticDecoder,
    StepOutput,
    decode_buckets,
    resolve_decode_step,
    span_for,
)

TOL = 1e-5


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Reads(TorchDispatchMode):
    """Storages of the tensors a run reads that it did not allocate itself (its external inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.external: set[int] = set()
        self._fresh: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {_storage(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        self.external |= {p for p in inputs - self._fresh if p}
        out = func(*args, **kwargs)
        self._fresh |= {_storage(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)} - inputs
        return out


class _Graph:
    def __init__(self, owner: RecordingCapture, fn, out: StepOutput, reads: set[int]) -> None:
        self.owner, self.fn, self.out, self.reads = owner, fn, out, reads

    def replay(self) -> None:
        with _Reads() as mode:
            logits, routes = self.fn()
        assert mode.external == self.reads, (
            f"a replay reads {len(mode.external - self.reads)} storages the capture did not "
            f"(and not {len(self.reads - mode.external)} it did): a rebound tensor or an uncopied input"
        )
        self.out[0].copy_(logits)  # a graph writes into the outputs it was captured with
        if routes is not None:
            self.out[1].copy_(routes)
        self.owner.replays += 1


class RecordingCapture:
    """CUDA graphs' contract on CPU: `capture(fn)` runs fn once and keeps its outputs and external reads;
    `replay()` reruns fn, asserts the same external storages, and writes into the captured outputs."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def __call__(self, fn) -> tuple[_Graph, StepOutput]:
        with _Reads() as mode:
            out = fn()
        self.captures += 1
        return _Graph(self, fn, out, mode.external), out


def _runner(model_dir: Path, step: str, **kw) -> ModelRunner:
    kw = {"num_slots": 8, "max_len": 64, "chunk": 16, "device": "cpu", **kw}
    return ModelRunner(model_path=str(model_dir), dtype="float32", decode_step=step, **kw)


def _recording(runner: ModelRunner, buckets: list[int] | None = None) -> RecordingCapture:
    capture = RecordingCapture()
    runner.static = StaticDecoder(runner, buckets, capture)
    return capture


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_equals_the_hand_written_one(dtype: torch.dtype) -> None:
    """CUDA runs RMSNorm by F.rms_norm (one kernel); the same function on CPU equals the hand-written CPU
    norm (HF's math): fp32 within 1e-6, bf16 within one rounding of the output."""
    from prime_async.inference.model_runner import _rms_norm, _rms_norm_fused

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 6, 64, generator=g) * 3).to(dtype)
    for weight in (None, (1 + torch.randn(6, 64, generator=g)).to(dtype)):
        want, got = _rms_norm(x, weight, 1e-6), _rms_norm_fused(x, weight, 1e-6)
        assert got.dtype == want.dtype == dtype
        rel = 1e-6 if dtype == torch.float32 else 2**-8
        torch.testing.assert_close(got.float(), want.float(), rtol=rel, atol=1e-6)


def test_buckets_spans_and_modes() -> None:
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert decode_buckets(6) == [1, 2, 4, 6] and decode_buckets(1) == [1]
    assert decode_buckets(8, [1, 3]) == [1, 3, 8]
    for bad in ([2, 2], [4, 1], [0, 4], [9]):
        with pytest.raises(ValueError, match="decode_buckets"):
            decode_buckets(8, bad)
    assert [span_for(n, 64) for n in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
    assert span_for(20, 24) == 24  # capped at the cache's capacity
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_decode_step("auto", cpu) == "static" and resolve_decode_step("auto", cuda) == "graphs"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_decode_step("graphs", cpu)
    with pytest.raises(ValueError, match="decode_step = 'graphs' needs CUDA"):
        InferenceConfig.model_validate({"engine": {"device": "cpu", "decode_step": "graphs"}})
    with pytest.raises(ValueError, match="decode_buckets"):
        InferenceConfig.model_validate({"engine": {"max_running_requests": 4, "decode_buckets": [1, 8]}})


def _prefill(runners: list[ModelRunner], seqs: list[list[int]], lens: list[int]) -> None:
    for r in runners:
        r.prefill([s[:n] for s, n in zip(seqs, lens, strict=True)], list(range(len(seqs))))


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_moe_model_dir"])
def test_static_step_equals_eager_step_at_every_batch_size(request, model: str) -> None:
    """Batches of 7, 6, 5, 3, 2, 1 rows (bucket sizes and not), slots compacted as the engine does, the
    cache growing past its first chunk (16 -> 32 -> 64 positions: graphs are dropped and re-captured):
    the static step's logits and MoE routes equal the eager step's at every row; each (bucket, span) is
    captured once and replayed after, reading the same storages."""
    torch.set_num_threads(1)
    model_dir = request.getfixturevalue(model)
    eager, static = _runner(model_dir, "eager"), _runner(model_dir, "static")
    capture = _recording(static)
    worst, steps = _steps_against_eager(eager, static)
    assert worst < TOL
    assert static.capacity == 64 and static.cache_generation == 3  # grew twice after the first chunk
    assert capture.replays == steps and capture.captures < steps // 2
    assert static.static.num_captures == capture.captures


def _steps_against_eager(eager: ModelRunner, static: ModelRunner) -> tuple[float, int]:
    """Largest |logprob| difference of `static`'s steps from `eager`'s (MoE routes asserted equal) over
    batches of 7, 6, 5, 3, 2, 1 rows, from prompts of 2..9 tokens to 60 positions; and the step count."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, eager.vocab_size, (60,), generator=g).tolist() for _ in range(7)]
    pos = [7, 5, 9, 3, 4, 6, 2]
    worst, steps = 0.0, 0
    with torch.inference_mode():
        _prefill([eager, static], seqs, pos)
        for batch, repeat in ((7, 4), (6, 4), (5, 8), (3, 6), (2, 8), (1, 12)):
            for _ in range(repeat):
                ids = [seqs[b][pos[b]] for b in range(batch)]
                want = eager.decode_rows(ids, pos[:batch]).log_softmax(-1)
                want_routes = eager.take_routes()
                got = static.decode_rows(ids, pos[:batch]).log_softmax(-1)
                got_routes = static.take_routes()
                assert got.shape == want.shape
                worst = max(worst, float((got - want).abs().max()))
                if want_routes is not None:
                    assert torch.equal(got_routes, want_routes)
                pos[:batch] = [p + 1 for p in pos[:batch]]
                steps += 1
    return worst, steps


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_moe_model_dir"])
def test_cuda_graphs_equal_eager_on_cuda(request, model: str) -> None:
    """On CUDA (the GPU check), real CUDA graphs: the same steps as on CPU give the eager step's logprobs
    (fp32, TF32 off) and routes; after a weight load the replays (no re-capture) compute the new weights'
    logprobs."""
    model_dir = request.getfixturevalue(model)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        eager, graphs = (_runner(model_dir, step, device="cuda") for step in ("eager", "graphs"))
        worst, _ = _steps_against_eager(eager, graphs)
        assert worst < 1e-4 and graphs.static.num_captures > 0 and graphs.static.capture is not None
        gen = torch.Generator().manual_seed(5)
        new = {
            k: v + 0.01 * torch.randn(v.shape, generator=gen).to(v)
            for k, v in eager.model.state_dict().items()
        }
        captured = graphs.static.num_captures
        for runner in (eager, graphs):
            runner.load_state(new, source="test")
        worst, _ = _steps_against_eager(eager, graphs)
        assert worst < 1e-4 and graphs.static.capture is not None
        assert graphs.static.num_captures == captured  # the cache stayed (64 = max_len): no re-capture
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def test_a_replay_after_a_weight_load_uses_the_new_weights(tiny_model_dir: Path) -> None:
    """A full load and a partial load (one bucket of a distributed update) copy into the storages the
    captured step reads: the replay (no re-capture) computes what a fresh eager runner on the new weights
    computes. A parameter rebound to new storage is caught by the recording capture."""
    torch.set_num_threads(1)
    static = _runner(tiny_model_dir, "static", kernels="dense")
    capture = _recording(static)
    seq = list(range(5, 25))
    new = {k: v + 0.01 * torch.randn_like(v) for k, v in static.model.state_dict().items()}

    def step(runner: ModelRunner) -> torch.Tensor:
        runner.prefill([seq[:10]], [0])
        return runner.decode_rows([seq[10]], [10]).log_softmax(-1)

    with torch.inference_mode():
        before = step(static)
        static.load_state(new, source="test")
        after_full = step(static)
        reference = _runner(tiny_model_dir, "eager", kernels="dense")
        reference.load_state(new, source="test")
        want = step(reference)
        norm = "model.layers.1.self_attn.q_norm.weight"  # read through the joint q/k-norm table
        static.load_state({norm: new[norm] * 3}, source="bucket", partial=True)
        reference.load_state({norm: new[norm] * 3}, source="bucket", partial=True)
        after_partial, want_partial = step(static), step(reference)
    assert capture.captures == 1 and capture.replays == 3
    assert float((after_full - before).abs().max()) > 1e-3  # the weights did change the output
    assert float((after_full - want).abs().max()) < TOL
    assert float((after_partial - after_full).abs().max()) > 1e-3
    assert float((after_partial - want_partial).abs().max()) < TOL
    old = static.model.model.layers[0].mlp.down_proj.weight
    old.data = old.data.clone()  # what a load must never do: the graph would keep reading the old storage
    static._fuse_weights()
    with torch.inference_mode(), pytest.raises(AssertionError, match="storages the capture did not"):
        step(static)


def test_lora_rows_and_eager_mode_take_the_eager_step(tiny_model_dir: Path, monkeypatch) -> None:
    """A step with any LoRA row runs `decode` (the static step serves no adapter); `decode_step = "eager"`
    builds no static decoder at all."""
    runner = _runner(tiny_model_dir, "static")
    assert _runner(tiny_model_dir, "eager").static is None
    calls: list[str] = []
    monkeypatch.setattr(runner, "static", lambda ids, positions: calls.append("static"))
    monkeypatch.setattr(runner, "decode", lambda *a, **k: calls.append("eager"))
    runner.decode_rows([5, 6], [3, 4], [None, object()])
    runner.decode_rows([5, 6], [3, 4], [None, None])
    runner.decode_rows([5, 6], [3, 4])
    assert calls == ["eager", "static", "static"]


PROMPTS = [[3 + (7 * i + j) % 200 for j in range(4 + i)] for i in range(7)]


async def _scenario(engine: Engine, new_state: dict[str, torch.Tensor]) -> list[list[RequestOutput]]:
    """Three requests start; four join once tokens flow; each leaves at its own length. Then a full weight
    update (flushing the cache) and the same seven again. Every request is seeded (its tokens depend on
    its prompt, seed and the weights only, not on which others share its steps)."""

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=6 + 3 * i, temperature=1.0, ignore_eos=True, sampling_seed=i)

    async def round_() -> list[RequestOutput]:
        start = engine.num_generated_tokens
        first = [asyncio.create_task(engine.generate(PROMPTS[i], params(i), return_routed_experts=True))
                 for i in range(3)]  # fmt: skip
        for _ in range(2000):  # deadline: 2000 x 5 ms
            if engine.num_generated_tokens >= start + 6:
                break
            await asyncio.sleep(0.005)
        joined = [engine.generate(PROMPTS[i], params(i), return_routed_experts=True) for i in range(3, 7)]
        return list(await asyncio.wait_for(asyncio.gather(*first, *joined), timeout=120))

    engine.start()
    try:
        one = await round_()
        update = engine.load_tensors(new_state, "1", flush_cache=True, source="t", partial=False)
        ok, message, _ = await update
        assert ok, message
        return [one, await round_()]
    finally:
        engine.stop()


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_moe_model_dir"])
def test_engine_static_decode_equals_eager_with_joins_leaves_and_an_update(request, model: str) -> None:
    """The whole engine, continuous batching (batches of 1..7 rows: bucket sizes and not), a weight update
    in between: the static engine (recording capture) samples the same tokens as the eager engine, with
    logprobs within 1e-5 and the same MoE routes; graphs survive the flush of the update (the cache is
    allocated whole here, so no (bucket, span) is ever captured twice)."""
    torch.set_num_threads(1)
    model_dir = request.getfixturevalue(model)
    state = None
    results, decoders, batches = {}, {}, {}
    for step in ("eager", "static"):
        slots = SlotSettings(max_running_requests=8, max_len=96, kv_cache_chunk=96, decode_step=step)
        engine = Engine(EngineSettings(model_path=str(model_dir), dtype="float32", device="cpu",
                                       kernels="dense", slots=slots))  # fmt: skip
        if step == "static":
            capture = _recording(engine.runner)
        seen = batches.setdefault(step, set())
        real = engine.runner.decode_rows
        engine.runner.decode_rows = lambda ids, pos, ad, real=real, seen=seen: (
            seen.add(len(ids)) or real(ids, pos, ad)
        )
        if state is None:
            gen = torch.Generator().manual_seed(3)
            state = {k: v + 0.02 * torch.randn(v.shape, generator=gen)
                     for k, v in engine.runner.model.state_dict().items()}  # fmt: skip
        results[step] = asyncio.run(_scenario(engine, state))
        decoders[step] = engine.runner.static
    assert {3, 5, 6, 7} <= batches["static"]  # padded to 4 and 8
    for round_eager, round_static in zip(results["eager"], results["static"], strict=True):
        for want, got in zip(round_eager, round_static, strict=True):
            assert got.output_ids == want.output_ids
            assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) < TOL
            if want.routed_experts is not None:
                assert torch.equal(got.routed_experts, want.routed_experts)
    assert results["eager"][0][0].output_ids != results["eager"][1][0].output_ids  # the update mattered
    decoder = decoders["static"]
    assert decoder.num_captures == len(decoder.graphs) == capture.captures and capture.replays > 0
