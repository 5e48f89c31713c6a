"""In-process chat harness for verifiers v1: the `null` harness's loop without its subprocess.

verifiers' `Harness` contract says "the interception is the contract, not the process: a harness may run
its loop in-process instead of launching a program, as long as every model call goes through
`endpoint` + `secret`". This harness does exactly that for text-only tasks: it posts the task's prompt to
the rollout's interception endpoint (`{endpoint}/chat/completions`, OpenAI chat shape), once per segment,
and returns a synthetic success `ProgramResult`. Everything else (rollout lifecycle, interception,
renderer/token bookkeeping, trace graph, scoring) is verifiers' own code path.

Loaded by id like any harness: `agent.harness.id = "prime_async_chat"`. verifiers resolves a harness id
to a top-level module (`verifiers.v1.harnesses.<id>` or `<id>`), and a dotted id fails its namespace
probe, so `register()` publishes this module under the top-level name `prime_async_chat` in
`sys.modules` (the rollout source calls it before loading the environment).

Invariants: no subprocess and no `uv` bootstrap (so no network); one model call per segment (the
tool loop of an environment lives in its `Env.run`, which resumes the exchange with user turns);
it never executes model-directed code (`EXECUTES_CODE = False`) and serves no MCP tools.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

logger = logging.getLogger(__name__)

__all__ = ["InProcessChatHarness", "InProcessChatHarnessConfig"]

HARNESS_ID = "prime_async_chat"


def register() -> str:
    """Make this module importable as the harness id `prime_async_chat`; returns the id."""
    sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])
    return HARNESS_ID


class InProcessChatHarnessConfig(vf.HarnessConfig):
    request_timeout_s: float = 600.0
    """How long one model call through the interception server may take."""


class InProcessChatHarness(vf.Harness[InProcessChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    SUPPORTS_MCP = False
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
        tool_interception_url: str | None = None,
    ) -> vf.ProgramResult:
        system_prompt, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = (
            [{"role": "system", "content": system_prompt}] if system_prompt else []
        )
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages.extend(message_to_wire(m) for m in prompt)
        body = {"model": ctx.model, "messages": messages}
        headers = {"Authorization": f"Bearer {secret}"}
        timeout = httpx.Timeout(self.config.request_timeout_s, connect=5.0)
        # verify=False: the interception endpoint is plain HTTP, and loading the CA bundle for a TLS
        # context costs ~0.2 s per client on these CPUs (it dominated the episode overhead).
        async with httpx.AsyncClient(timeout=timeout, verify=False) as client:
            response = await client.post(
                f"{endpoint.rstrip('/')}/chat/completions", json=body, headers=headers
            )
        if response.status_code != 200:
            # The interception server already recorded the failed call on the trace; exit non-zero so
            # verifiers' `_check_result` classifies it like a failed program.
            return vf.ProgramResult(exit_code=1, stdout="", stderr=response.text[-2000:])
        content = response.json()["choices"][0]["message"].get("content") or ""
        return vf.ProgramResult(exit_code=0, stdout=content, stderr="")
