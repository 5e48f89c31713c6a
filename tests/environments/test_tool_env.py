"""MCP tool environments end to end: verifiers' chat/tool loop in process, toolsets served in process.

The environment is `calculator-tools` (a real `vf.Toolset` with an `@vf.tool`, declared per task). A
random tiny model never writes a well-formed tool call, so the masking test uses a scripted engine
(an `EngineClient` that answers the first turn with one Qwen3 tool call and later turns with an answer;
mocked because a trained tool-calling model cannot run here); everything else is real: verifiers'
rollout, interception, the qwen3 renderer chosen from the tiny model, the MCP server and its state
channel, the gateway, and `rl` with the real engine and trainer processes.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import pytest

import zygote
from prime_async.config.env import EnvConfig
from prime_async.engine_api import GenerateResult, SamplingParams
from prime_async.rollouts.renderer_choice import choose_renderer, renderer_for_model
from prime_async.rollouts.verifiers_source import build_rollout_source
from proc_helpers import free_port, read_jsonl

ROOT = Path(__file__).resolve().parents[2]
TOOL_CALL = (
    '<tool_call>\n{"name": "calculator_calculate", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
)


class ScriptedToolEngine:
    """First turn: one calculator tool call; once a tool response is in the prompt: `<answer>5</answer>`."""

    def __init__(self, tokenizer: Any) -> None:
        self.base_url = "scripted://engine"
        self.stop = tokenizer.eos_token_id
        self.call = tokenizer.encode(TOOL_CALL)
        self.answer = tokenizer.encode("<answer>5</answer>")
        self.response_id = tokenizer.convert_tokens_to_ids("<tool_response>")
        self.prompts: list[list[int]] = []

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None):
        self.prompts.append(list(input_ids))
        ids = [*(self.answer if self.response_id in input_ids else self.call), self.stop]
        return GenerateResult(rid or "r", ids, [-0.5] * len(ids), [3] * len(ids), "stop", len(input_ids), 0)

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        return None

    async def weight_version(self) -> int:
        return 3


def _run(tiny_model_dir: Path, engine: Any, env_cfg: EnvConfig, n: int = 1) -> list[Any]:
    async def main() -> list[Any]:
        source = build_rollout_source(
            env_cfg=env_cfg, engines=[engine], model_path=str(tiny_model_dir), seq_len=1024
        )
        async with source:
            sampling = SamplingParams(temperature=1.0, max_tokens=64)
            return [
                await source.run_episode(example_id=i, engine_key="0", sampling=sampling) for i in range(n)
            ]

    return asyncio.run(main())


def test_renderer_chosen_from_the_model(tiny_model_dir: Path) -> None:
    assert renderer_for_model(str(tiny_model_dir)) == "qwen3"
    assert renderer_for_model("Qwen/Qwen3-8B") == "qwen3"
    assert choose_renderer({"name": "default"}, str(tiny_model_dir)) == {"name": "default"}
    assert choose_renderer({}, str(tiny_model_dir)) == {"name": "qwen3"}


@pytest.mark.parametrize("toolsets", ["inprocess", "verifiers"])
def test_tool_episode_masks_tool_call_results(
    tiny_model_dir: Path, toolsets: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    from prime_async.rollouts import inprocess_tools

    served: list[str] = []
    serve_toolset = inprocess_tools.serve_toolset

    def counting(toolset: Any, **kwargs: Any) -> Any:
        served.append(type(toolset).__name__)
        return serve_toolset(toolset, **kwargs)

    monkeypatch.setattr(inprocess_tools, "serve_toolset", counting)

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = ScriptedToolEngine(tok)
    env_cfg = EnvConfig(id="calculator-tools", toolsets=toolsets, args={"num_examples": 4})
    (ep,) = _run(tiny_model_dir, engine, env_cfg)
    assert ep.status == "ok", ep.error
    # in process: the orchestrator hosted the toolset; "verifiers": verifiers' tool-server subprocess did
    assert served == (["CalculatorToolset"] if toolsets == "inprocess" else [])
    assert ep.metrics["num_model_calls"] == 2
    assert ep.metrics["env/tool_calls"] == 1.0  # the toolset's state reached the trace over /state
    ids, mask = ep.token_ids, ep.loss_mask
    sampled = [t for t, m in zip(ids, mask, strict=True) if m]
    assert sampled == [*engine.call, engine.stop, *engine.answer, engine.stop]
    # the tool result ("5" inside <tool_response>) is in the sequence and never trained on
    start = ids.index(engine.response_id)
    end = ids.index(tok.convert_tokens_to_ids("</tool_response>"))
    assert tok.decode(ids[start + 1 : end]).strip() == "5"
    assert not any(mask[start : end + 1])
    assert set(ep.token_versions[i] for i, m in enumerate(mask) if m) == {3}


def test_tool_env_needs_a_tool_renderer(tiny_model_dir: Path) -> None:
    env_cfg = EnvConfig(id="calculator-tools", renderer={"name": "default"}, args={"num_examples": 2})
    with pytest.raises(ValueError, match=r"calculator-tools.*no tool-capable renderer") as info:
        _run(tiny_model_dir, ScriptedToolEngine.__new__(ScriptedToolEngine), env_cfg, n=0)
    assert "\n" not in str(info.value)


def _rl_tool_env(tiny_model_dir: Path, tmp_path: Path, runner: str, steps: int = 2) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(ROOT / "configs/tiny/rl.toml"),
        "--output-dir", str(out), "--model.path", str(tiny_model_dir), "--max-steps", str(steps),
        "--inference.server.port", str(free_port()), "--transport.port", str(free_port()),
        "--orchestrator.env.id", "calculator-tools", "--orchestrator.env.runner", runner,
        "--orchestrator.sampling.max-tokens", "24", "--seq-len", "1024",  # the tools prompt is ~530 tokens
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline"}
    proc = zygote.run(cmd, cwd=ROOT, env=env, timeout=840)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((out / "logs").glob("*.log")))
    assert proc.returncode == 0, f"rl exited {proc.returncode}:\n{proc.stderr[-3000:]}\n{logs}"
    orch = read_jsonl(out / "metrics" / "orchestrator.jsonl")
    assert [m["step"] for m in orch] == list(range(steps))
    trainer = read_jsonl(out / "metrics" / "trainer.jsonl")
    assert [m["step"] for m in trainer] == list(range(steps))
    assert "renderer=qwen3" in (out / "logs" / "orchestrator.log").read_text()


@pytest.mark.timeout(900)
def test_rl_trains_on_tool_env_inprocess(tiny_model_dir: Path, tmp_path: Path) -> None:
    _rl_tool_env(tiny_model_dir, tmp_path, "inprocess")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rl_trains_on_tool_env_env_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    _rl_tool_env(tiny_model_dir, tmp_path, "env_server", steps=1)  # ~15 s per episode through env_server
