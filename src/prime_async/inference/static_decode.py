"""The embedded engine's decode step at bucketed batch sizes over static buffers, replayed as CUDA graphs.

A decode step over B running slots is launch-bound on a GPU (hundreds of small kernels per step: ~20 ms
for a 0.36B model whose weights read in ~0.3 ms). This module runs the same step with every shape fixed by
two small integers, so that CUDA can record it once and replay it with one launch:

    engine: ids, positions of slots 0..B-1 (host lists)
        ──pad to the bucket──► `inputs` (2, num_slots) long, rows B..bucket-1 = token 0 at position 0
        ──step (bucket, span)──► graph replay (CUDA, `decode_step = "graphs"`) or the same step uncaptured
        ──rows 0..B-1──► logits (B, V), MoE routes (B, layers, k)

- bucket: the smallest of `buckets` (1, 2, 4, ..., max_running_requests by default) >= B;
- span: the KV positions attended, the smallest power of two >= max(positions) + 1 (at least `MIN_SPAN`),
  capped at the cache's capacity; rows are masked to their own [0, position].

Used by `inference/model_runner.py` (`ModelRunner.decode_rows`), configured by `inference.engine.decode_step`
and `decode_buckets` (`config/inference.py`).

Invariants (what keeps a captured graph valid; each is tested on CPU with a recording capture):
- every tensor the step reads that exists before the step (weights, KV cache, rope tables, `inputs`) is
  the same storage at every replay: inputs are copied into `inputs`, weights are copied into the
  parameters in place (`ModelRunner.load_state`; the derived q/k-norm table too), never rebound;
- a KV-cache reallocation (growth) drops every graph (`runner.cache_generation`); with graphs the cache keeps
  its size on flush (`runner.keep_cache_on_flush`), so weight updates do not force re-captures;
- padded rows write k/v only at position 0 of slots bucket > s >= B, which hold no running request (slots
  0..B-1 are the running ones; a later prefill overwrites what it uses), and rows never mix, so padding
  changes no real row beyond the summation order of a wider matmul;
- a replay's outputs live in the graphs' shared memory pool: they are copied out before the next replay;
- LoRA rows are not served here: a step with any adapter runs the eager `ModelRunner.decode`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch

logger = logging.getLogger(__name__)

DecodeStep = Literal["auto", "eager", "static", "graphs"]
MIN_SPAN = 16  # smallest attended span: fewer graphs, and short spans cost nothing to pad
WARMUP_RUNS = 2  # uncaptured runs on a side stream before a capture (cuBLAS workspaces, lazy init)

StepOutput = tuple[torch.Tensor, torch.Tensor | None]  # logits (bucket, V), routes (bucket, layers, k)


def resolve_decode_step(step: DecodeStep, device: torch.device) -> Literal["eager", "static", "graphs"]:
    """`auto`: graphs on CUDA, the static step uncaptured elsewhere. `graphs` off CUDA is an error."""
    if step == "auto":
        return "graphs" if device.type == "cuda" else "static"
    if step == "graphs" and device.type != "cuda":
        raise ValueError(f"decode_step = 'graphs' needs a CUDA device; this engine runs on {device}")
    if step not in ("eager", "static", "graphs"):
        raise ValueError(f"decode_step = {step!r}: expected auto, eager, static or graphs")
    return step


def decode_buckets(num_slots: int, buckets: list[int] | None = None) -> list[int]:
    """The batch sizes a step is padded to: `buckets` (strictly increasing, 1..num_slots) or powers of two,
    then `num_slots` appended when missing, so that every batch has a bucket."""
    if buckets is None:
        buckets = [1 << i for i in range(num_slots.bit_length()) if 1 << i < num_slots]
    bad = [b for b in buckets if not 1 <= b <= num_slots]
    if bad or any(a >= b for a, b in itertools.pairwise(buckets)):
        raise ValueError(
            f"decode_buckets {buckets}: must increase strictly, each in 1..max_running_requests ({num_slots})"
        )
    return list(buckets) if buckets and buckets[-1] == num_slots else [*buckets, num_slots]


def span_for(length: int, capacity: int) -> int:
    """KV positions a step attends to: the smallest power of two >= `length` (>= MIN_SPAN), <= capacity."""
    assert 0 < length <= capacity, f"length {length} outside the cache's capacity {capacity}"
    return min(capacity, max(MIN_SPAN, 1 << (length - 1).bit_length()))


class Graph(Protocol):
    def replay(self) -> None: ...


class StaticRunner(Protocol):
    """What a `StaticDecoder` uses of its model runner (`inference/model_runner.py`'s `ModelRunner`)."""

    num_slots: int
    device: torch.device
    capacity: int  # KV positions the cache holds
    cache_generation: int  # bumped whenever the cache tensors are reallocated
    keep_cache_on_flush: bool  # set here when capturing: graphs read the cache tensors

    def prepare_decode(self, length: int, adapters: list[Any] | None, batch: int) -> None: ...

    def static_forward(self, ids: torch.Tensor, positions: torch.Tensor, span: int) -> StepOutput: ...

    def set_routes(self, routes: torch.Tensor | None) -> None: ...


class Capture(Protocol):
    """Records `fn` (which returns the step's outputs) once; `replay()` recomputes into those outputs."""

    def __call__(self, fn: Callable[[], StepOutput]) -> tuple[Graph, StepOutput]: ...


class CudaGraphs:
    """`torch.cuda.CUDAGraph` captures sharing one memory pool (safe: graphs replay one at a time on the
    engine thread, and each replay's outputs are copied out before the next one)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: Callable[[], StepOutput]) -> tuple[Graph, StepOutput]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (the server's event loop) do not void the capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        return graph, out


class StaticDecoder:
    """Decode steps of one `ModelRunner` at bucketed batch sizes; captured per (bucket, span) when a
    `capture` is given (lazily, at first use), else run uncaptured with the same shapes."""

    def __init__(self, runner: StaticRunner, buckets: list[int], capture: Capture | None = None) -> None:
        self.runner = runner
        self.buckets = decode_buckets(runner.num_slots, buckets)
        self.capture = capture
        runner.keep_cache_on_flush = capture is not None
        with torch.inference_mode():  # written in place inside the inference-mode step
            self.inputs = torch.zeros(2, runner.num_slots, dtype=torch.long, device=runner.device)
        self.graphs: dict[tuple[int, int], tuple[Graph, StepOutput]] = {}
        self._generation = runner.cache_generation
        self.num_captures = 0

    def bucket_for(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    @torch.inference_mode()
    def __call__(self, ids: list[int], positions: list[int]) -> torch.Tensor:
        """One step for slots 0..B-1 (B = len(ids)): logits (B, V); the routes go to `runner.take_routes`."""
        runner, batch = self.runner, len(ids)
        bucket = self.bucket_for(batch)
        length = max(positions) + 1
        runner.prepare_decode(length, None, batch)
        if runner.cache_generation != self._generation:  # the cache moved: every graph reads the old one
            self.graphs.clear()
            self._generation = runner.cache_generation
        span = span_for(length, runner.capacity)
        host = torch.zeros(2, bucket, dtype=torch.long)
        host[0, :batch] = torch.tensor(ids)
        host[1, :batch] = torch.tensor(positions)
        self.inputs[:, :bucket].copy_(host)
        logits, routes = self._run(bucket, span)
        runner.set_routes(None if routes is None else routes[:batch])
        return logits[:batch]

    def _step(self, bucket: int, span: int) -> Callable[[], StepOutput]:
        ids, positions = self.inputs[0, :bucket], self.inputs[1, :bucket]
        return lambda: self.runner.static_forward(ids, positions, span)

    def _run(self, bucket: int, span: int) -> StepOutput:
        step = self._step(bucket, span)
        if self.capture is None:
            return step()
        entry = self.graphs.get((bucket, span))
        if entry is None:
            try:
                entry = self.capture(step)
            except Exception:  # never fail serving over a capture: run uncaptured from now on
                logger.exception("decode graph capture failed (bucket %d, span %d): running uncaptured",
                                 bucket, span)  # fmt: skip
                self.capture = None
                self.graphs.clear()
                return step()
            self.graphs[(bucket, span)] = entry
            self.num_captures += 1
            logger.debug("captured the decode step at batch %d, span %d", bucket, span)
        graph, (logits, routes) = entry
        graph.replay()
        return logits.clone(), None if routes is None else routes.clone()

    def describe(self) -> dict[str, Any]:
        """What the decoder holds (for logs and tests)."""
        return {"buckets": self.buckets, "graphs": sorted(self.graphs), "captures": self.num_captures,
                "captured": self.capture is not None}  # fmt: skip
