"""In-process chat harness for verifiers v1: the `null` harness's chat/tool program, run in this process.

verifiers' `Harness` contract says "the interception is the contract, not the process: a harness may run
its loop in-process instead of launching a program, as long as every model call goes through
`endpoint` + `secret`". verifiers' `null` harness launches its chat program (the bundled source of
`verifiers.v1.harnesses.utils.{mcp,compaction,core}`, `CHAT_PROGRAM_SOURCE`) as a `uv`-bootstrapped
subprocess. This harness executes that same bundled source once into a private module namespace and
drives its loop (`connect_mcp`, `Compactor`, `run_chat_loop`: MCP tools of the task and the taskset, the
tool-interception gate, context-overflow handling) as coroutines in the orchestrator's event loop. The
only difference to the subprocess is the program's `mcp_client`: `inproc://` tool URLs (toolsets served
in process by `inprocess_tools.py`) use the MCP SDK's in-memory transport. Everything else (rollout
lifecycle, interception, renderer/token bookkeeping, masks, trace graph, scoring) is verifiers' own path.

Loaded by id like any harness: `agent.harness.id = "prime_async_chat"`. verifiers resolves a harness id
to a top-level module (`verifiers.v1.harnesses.<id>` or `<id>`), and a dotted id fails its namespace
probe, so `register()` publishes this module under the top-level name `prime_async_chat` in
`sys.modules` (the rollout source calls it before loading the environment).

Invariants: no subprocess and no `uv` bootstrap (so no network); every model call goes through the
interception endpoint; resume relaunches the loop on the accreted conversation (verifiers' default);
the program's failures map to exit codes as in the subprocess (97 = model transport, 1 = crash), so
verifiers' `_check_result` classifies them; it never executes model-directed code (`EXECUTES_CODE`).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import sys
import traceback
import types
import weakref
from contextlib import AsyncExitStack
from typing import Any

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

from prime_async.rollouts import inprocess_tools

logger = logging.getLogger(__name__)

__all__ = ["InProcessChatHarness", "InProcessChatHarnessConfig", "chat_program"]

HARNESS_ID = "prime_async_chat"


def register() -> str:
    """Make this module importable as the harness id `prime_async_chat`; returns the id."""
    sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])
    inprocess_tools.install()
    return HARNESS_ID


class _LoopClients:
    """The pooled model-call clients of one event loop and how many rollout sources use them."""

    def __init__(self) -> None:
        self.by_timeout: dict[float, httpx.AsyncClient] = {}
        self.users = 0


_LOOP_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopClients]
_LOOP_CLIENTS = weakref.WeakKeyDictionary()


def _loop_clients() -> _LoopClients:
    return _LOOP_CLIENTS.setdefault(asyncio.get_running_loop(), _LoopClients())


def shared_http_client(request_timeout_s: float) -> httpx.AsyncClient:
    """The running loop's pooled HTTP client for model calls to interception endpoints.

    One per (event loop, request timeout), reused by every episode: a fresh client per episode cost
    an SSL context, a TCP connect and the pool setup each time (~5% of the orchestrator's CPU on the
    tiny config). verify=False: the interception endpoint is plain HTTP on loopback, and loading the CA
    bundle for a TLS context costs ~0.2 s per client on these CPUs.
    """
    clients = _loop_clients().by_timeout
    client = clients.get(request_timeout_s)
    if client is None or client.is_closed:
        timeout = httpx.Timeout(request_timeout_s, connect=5.0)
        client = chat_program().DefaultAsyncHttpxClient(verify=False, timeout=timeout)
        clients[request_timeout_s] = client
    return client


def retain_http_clients() -> None:
    """A rollout source of this loop starts using the shared clients (pair with `release_...`)."""
    _loop_clients().users += 1


async def release_http_clients() -> None:
    """A rollout source stopped; the last one to stop closes the loop's shared clients."""
    entry = _loop_clients()
    entry.users = max(entry.users - 1, 0)
    if entry.users == 0:
        clients, entry.by_timeout = entry.by_timeout, {}
        for client in clients.values():
            await client.aclose()


@functools.cache
def chat_program() -> types.ModuleType:
    """verifiers' bundled chat program as a private module (its `__main__` entry point stays inert)."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

    module = types.ModuleType("prime_async_vf_chat_program")
    exec(compile(CHAT_PROGRAM_SOURCE, "<verifiers chat program>", "exec"), module.__dict__)
    module.mcp_client = inprocess_tools.mcp_client_factory(module.mcp_client)
    return module


class InProcessChatHarnessConfig(vf.HarnessConfig):
    request_timeout_s: float = 600.0
    """How long one model call through the interception server may take."""
    mcp_connect_timeout_s: float = 60.0
    """How long listing the tools of all MCP servers may take (the program's own limit)."""


class InProcessChatHarness(vf.Harness[InProcessChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    SUPPORTS_MCP = True
    SUPPORTS_TOOL_INTERCEPTION = True
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
        args = argparse.Namespace(
            base_url=endpoint, api_key=secret, model=ctx.model, tool_interception_url=tool_interception_url,
            bash=False, edit=False, search=False, serper_key="", compaction=False, summarize_at_tokens=None,
        )  # fmt: skip
        servers = {name: {"url": url, "timeout": self.config.tool_timeout} for name, url in mcp_urls.items()}
        try:
            reply = await self._run_program(args, messages, servers)
        except SystemExit as e:  # the program's model-transport exit
            code = e.code if isinstance(e.code, int) else 1
            return vf.ProgramResult(exit_code=code, stdout="", stderr=traceback.format_exc()[-2000:])
        except Exception:  # tolerated: a crash of the program is its non-zero exit, as in the subprocess
            return vf.ProgramResult(exit_code=1, stdout="", stderr=traceback.format_exc()[-2000:])
        return vf.ProgramResult(exit_code=0, stdout=reply, stderr="")

    async def _run_program(
        self, args: argparse.Namespace, messages: list[dict[str, Any]], servers: dict[str, Any]
    ) -> str:
        """The body of the chat program's `main()` with its arguments given directly."""
        program = chat_program()
        timeout = httpx.Timeout(self.config.request_timeout_s, connect=5.0)
        # The episode's OpenAI client rides on the loop's shared connection pool (`shared_http_client`),
        # so it is not closed here: closing an SDK client closes the httpx client under it.
        client = program.AsyncOpenAI(
            base_url=args.base_url, api_key=args.api_key, timeout=timeout,
            http_client=shared_http_client(self.config.request_timeout_s),
        )  # fmt: skip
        async with AsyncExitStack() as stack:
            tool_client = None
            if args.tool_interception_url:
                tool_client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), verify=False)
                stack.push_async_callback(tool_client.aclose)
            tools, dispatch, connections = [], {}, {}
            if servers:
                tools, dispatch, connections = await program.asyncio.wait_for(
                    program.connect_mcp({"mcpServers": servers}, stack, set()),
                    timeout=self.config.mcp_connect_timeout_s,
                )
            compactor = program.Compactor(client, args.model, tools, False, None)
            compactor.note_good(messages)
            await program.run_chat_loop(args, compactor, messages, dispatch, connections, tool_client)
        last = messages[-1] if messages else {}
        content = last.get("content") if last.get("role") == "assistant" else ""
        return content if isinstance(content, str) else json.dumps(content)
