"""Serve a rollout's Python toolsets inside the orchestrator: no tool-server process per episode.

verifiers starts each task-scoped toolset (`vf.Toolset` with `@vf.tool` methods) as a Python
subprocess per rollout (`python -m <module>`, a port file and a probe process), which costs seconds
per episode here. With the in-process runner, `serve_tools` below takes the place of verifiers'
`verifiers.v1.rollout.serve_tools` (the one seam where a rollout brings up its tool servers; `install()`
rebinds that name): each toolset instance the rollout built (`Task.toolsets(config)`, fresh per rollout)
is set up in this process exactly as verifiers' server process would set it up (`setup()`, then
`setup_task(task)` with the task read from the rollout's interception `/task` channel), registered on its
own in-memory `MCPServer` (verifiers' `Toolset.register`), and published to the harness under an
`inproc://` URL. The in-process harness (`envs/inprocess_harness.py`) reaches such a URL through the MCP SDK's
in-memory transport (`mcp.Client(server)`): the same MCP `list_tools` / `call_tool` requests, no HTTP.

Invariants:
- only toolsets verifiers would run as a local subprocess are served here (no `config.url`, a
  `subprocess` runtime); toolsets given by URL, in a sandbox runtime, and the taskset-scoped (shared)
  servers go verifiers' own way (its `serve_tools`, unchanged);
- per-rollout state: each toolset syncs its `State` over this rollout's interception `/state` channel
  (verifiers' own pull/push around every call), never through process-wide environment variables;
- the registry maps a URL to a server only while its rollout's tool context is open;
- in-process serving applies only inside `enabled()` (a context variable, so concurrent sources and
  the benchmark's comparison runs do not affect each other); elsewhere verifiers' path runs unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

INPROC_SCHEME = "inproc://"
_SERVERS: dict[str, Any] = {}
_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("prime_async_inproc_tools", default=False)
_VF_SERVE_TOOLS: Any = None


@contextlib.contextmanager
def enabled(active: bool = True) -> Iterator[None]:
    """Serve Python toolsets in process for rollouts started inside this block (and tasks it spawns)."""
    token = _ACTIVE.set(active)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def install() -> None:
    """Route verifiers' per-rollout tool serving through `serve_tools` (idempotent)."""
    global _VF_SERVE_TOOLS
    import verifiers.v1.rollout as vf_rollout

    if _VF_SERVE_TOOLS is None:
        _VF_SERVE_TOOLS = vf_rollout.serve_tools
        vf_rollout.serve_tools = serve_tools


def servable_in_process(toolset: Any) -> bool:
    """Whether verifiers would run `toolset` as a local Python subprocess (so we may host it here)."""
    from verifiers.v1.mcp.server import ServerBase

    cfg = toolset.config
    runtime = getattr(cfg, "runtime", None)
    return (
        isinstance(toolset, ServerBase)
        and getattr(cfg, "url", None) is None
        and getattr(runtime, "type", "subprocess") == "subprocess"
    )


async def _fetch_task(client: Any, state_url: str, secret: str) -> Any:
    """The rollout's task from the interception `/task` channel (what verifiers' server process reads)."""
    from verifiers.v1.mcp.server import _channel_request, _import_ref

    task_url = state_url[: -len("/state")] + "/task"
    data = (await _channel_request("GET", task_url, secret, client=client)).json()
    return _import_ref(data["cls"]).model_validate_json(data["task"])


@contextlib.asynccontextmanager
async def serve_toolset(toolset: Any, *, state_url: str | None, state_secret: str) -> AsyncIterator[str]:
    """Set up one per-rollout toolset in process and yield its `inproc://` URL while it serves."""
    import httpx
    import verifiers
    from mcp.server.mcpserver import MCPServer
    from verifiers.v1.mcp.server import STATE_TIMEOUT

    channel = (state_url, state_secret, None) if state_url else (None, "", None)
    # This instance belongs to one rollout: point its state channel at that rollout (verifiers' server
    # process reads the same coordinates from its environment).
    toolset._state_channel = lambda: channel
    async with contextlib.AsyncExitStack() as stack:
        # plain-HTTP loopback channel: verify=False skips loading the CA bundle (~0.2 s per client here)
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=STATE_TIMEOUT, verify=False))
        toolset._state_client = client
        await stack.enter_async_context(toolset._exit_stack)
        await toolset.setup()
        if state_url:
            await toolset.setup_task(await _fetch_task(client, state_url, state_secret))
        # log_level: MCPServer() runs `logging.basicConfig(level=...)` (a no-op where the entrypoint set up
        # logging); WARNING keeps its per-request INFO lines out of a bare process (tests, benchmarks).
        server = MCPServer(
            toolset.server_name or type(toolset).__name__, version=verifiers.__version__, log_level="WARNING"
        )
        toolset.register(server)
        url = f"{INPROC_SCHEME}{uuid.uuid4().hex}/{toolset.server_name or 'tools'}"
        _SERVERS[url] = server
        try:
            yield url
        finally:
            _SERVERS.pop(url, None)
            toolset._state_client = None


@contextlib.asynccontextmanager
async def serve_tools(
    toolsets: list[Any],
    harness_runtime: Any,
    shared: dict[str, Any] | None = None,
    *,
    state_secret: str = "",
    state_route: str = "",
    state_base: str | None = None,
) -> AsyncIterator[dict[str, str]]:
    """verifiers' `serve_tools` contract; Python toolsets are served in process when `enabled()`."""
    from verifiers.v1.errors import ToolsetError

    assert _VF_SERVE_TOOLS is not None, "install() first"
    local = [t for t in toolsets if _ACTIVE.get() and servable_in_process(t)]
    rest = [t for t in toolsets if not any(t is x for x in local)]
    async with contextlib.AsyncExitStack() as stack:
        urls = dict(
            await stack.enter_async_context(
                _VF_SERVE_TOOLS(
                    rest,
                    harness_runtime,
                    shared,
                    state_secret=state_secret,
                    state_route=state_route,
                    state_base=state_base,
                )
            )
        )
        state_url = harness_runtime.host_url(f"{state_base.rstrip('/')}/state") if state_base else None
        for toolset in local:
            name = toolset.server_name
            if name in urls:
                raise ToolsetError(
                    f"tool server name {name!r} is declared twice; give one a distinct TOOL_PREFIX"
                )
            urls[name] = await stack.enter_async_context(
                serve_toolset(toolset, state_url=state_url, state_secret=state_secret)
            )
        yield urls


def mcp_client_factory(http_client: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
    """An `mcp_client(spec)` for verifiers' chat program: `inproc://` URLs open the in-memory MCP
    transport to the served toolset; any other URL goes to `http_client` (the program's own)."""

    @contextlib.asynccontextmanager
    async def mcp_client(spec: dict[str, Any]) -> AsyncIterator[Any]:
        url = spec["url"]
        if not url.startswith(INPROC_SCHEME):
            async with http_client(spec) as client:
                yield client
            return
        from mcp import Client

        server = _SERVERS.get(url)
        if server is None:
            raise ConnectionError(f"in-process tool server {url} is not serving (its rollout ended)")
        async with Client(server) as client:
            yield client

    return mcp_client
