"""The lookup tool, served over MCP: one in-memory `MCPServer` per environment, a client per episode.

The environment (not the model) calls it, so the number of calls and their latencies are the ones the
config sets, whatever the policy answers: the benchmark's long tail is the environment's, as in agentic
tasks whose tool work does not depend on the model's wording.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from lookup_agent.corpus import call_latency


class LookupTools:
    """`lookup(record, task, call)`: waits the call's latency, returns the record's code."""

    def __init__(self, corpus: dict[str, str], *, seed: int, median_s: float, sigma: float, max_s: float):
        from mcp.server.mcpserver import MCPServer

        self.corpus, self.seed = corpus, seed
        self.median_s, self.sigma, self.max_s = median_s, sigma, max_s
        self.server = MCPServer(name="lookup", log_level="WARNING")
        self.server.add_tool(self.lookup, name="lookup", description="Look up a record of the corpus by id.")

    async def lookup(self, record: str, task: str, call: int) -> str:
        """The code of `record` (after the call's latency); "not found" for an unknown id."""
        await asyncio.sleep(call_latency(self.seed, task, call, median_s=self.median_s, sigma=self.sigma,
                                         max_s=self.max_s))  # fmt: skip
        code = self.corpus.get(record)
        return code if code is not None else "not found"

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[Any]:
        """An MCP client of the server (the SDK's in-memory transport: MCP messages, no sockets)."""
        from mcp import Client

        async with Client(self.server) as client:
            yield client
