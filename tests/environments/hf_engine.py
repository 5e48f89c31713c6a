"""In-test `EngineClient` that runs a real HF causal LM (the tiny model) token by token.

Used by the environment tests until/unless the embedded engine (`uv run inference`) is available: real
weights, real sampling, real logprobs (log-softmax of logits / temperature), per-token versions.
`force_next(ids)` teacher-forces the next completion (the model still scores every forced token, so the
logprobs are its true logprobs); tests use it to make the random tiny model emit a tool call.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from typing import Any

import torch

from prime_async.engine_api import GenerateResult


class HFEngineClient:
    """One engine: serializes decoding steps on the event loop (tiny model, CPU)."""

    def __init__(
        self, *, model_dir: str, base_url: str = "hf://tiny", version: int = 0, seed: int = 0
    ) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.base_url = base_url
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.version = version
        self.generator = torch.Generator().manual_seed(seed)
        self.forced: deque[list[int]] = deque()
        self.aborted: set[str] = set()
        self.inflight: set[str] = set()
        self.requests: list[dict[str, Any]] = []
        self.outputs: list[list[int]] = []
        self.abort_log: list[str] = []
        self._ids = itertools.count()

    def force_next(self, token_ids: list[int]) -> None:
        self.forced.append(list(token_ids))

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None
    ) -> GenerateResult:
        rid = rid or f"hf-{next(self._ids)}"
        self.requests.append(
            {"input_ids": list(input_ids), "sampling_params": dict(sampling_params), "rid": rid}
        )
        temperature = float(sampling_params.get("temperature", 1.0)) or 1.0
        max_new = int(sampling_params.get("max_new_tokens", 16))
        stops = set(sampling_params.get("stop_token_ids") or [])
        forced = self.forced.popleft() if self.forced else None
        self.inflight.add(rid)
        out_ids: list[int] = []
        logprobs: list[float] = []
        finish = "length"
        past = None
        step_input = torch.tensor([input_ids])
        try:
            for step in range(max_new):
                await asyncio.sleep(0)  # a cancellation / abort point between tokens
                if rid in self.aborted:
                    finish = "abort"
                    break
                with torch.no_grad():
                    out = self.model(input_ids=step_input, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logp = torch.log_softmax(out.logits[0, -1].float() / temperature, dim=-1)
                if forced is not None:
                    if step >= len(forced):
                        finish = "stop"
                        break
                    token = forced[step]
                else:
                    token = int(torch.multinomial(logp.exp(), 1, generator=self.generator))
                out_ids.append(token)
                logprobs.append(float(logp[token]))
                if token in stops:
                    finish = "stop"
                    break
                step_input = torch.tensor([[token]])
        finally:
            self.inflight.discard(rid)
            self.aborted.discard(rid)
            self.outputs.append(list(out_ids))
        return GenerateResult(
            rid=rid,
            output_ids=out_ids,
            output_logprobs=logprobs,
            token_versions=[self.version] * len(out_ids),
            finish_type=finish,  # type: ignore[arg-type]
            prompt_tokens=len(input_ids),
            weight_version=self.version,
        )

    async def pause_generation(self, mode: str) -> None:
        return None

    async def continue_generation(self) -> None:
        return None

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int, *, flush_cache: bool, abort_all_requests: bool = False
    ) -> None:
        self.version = weight_version

    async def flush_cache(self) -> None:
        return None

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        self.abort_log.append("*" if abort_all else str(rid))
        if abort_all:
            self.aborted |= self.inflight
        elif rid is not None and rid in self.inflight:
            self.aborted.add(rid)

    async def weight_version(self) -> int:
        return self.version

    async def health(self) -> bool:
        return True

    async def server_info(self) -> dict[str, Any]:
        return {}  # no busy/uptime counters
