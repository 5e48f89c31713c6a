"""Real verifiers episodes of both example environments against the tiny model, through the gateway.

The engine is `hf_engine.HFEngineClient` (the tiny model sampled by HF in-process: real tokens, real
logprobs); `test_episode_against_embedded_engine_process` repeats one episode against the project's
embedded engine (`uv run inference`) through `HttpEngineClient`. The random tiny model never writes a
calculator call on its own, so the calculator test teacher-forces the two policy turns (the engine still
scores every forced token with the model: the logprobs are the model's).
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hf_engine import HFEngineClient

from prime_async.config.env import EnvConfig
from prime_async.engine_api import SamplingParams
from prime_async.rollouts.types import Episode
from prime_async.rollouts.verifiers_source import VerifiersRolloutSource, build_rollout_source

pytest.importorskip("verifiers.v1")

SAMPLING = SamplingParams(temperature=1.0, max_tokens=12)
FAULTY = Path(__file__).parent / "faulty_rewards.py"


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> HFEngineClient:
    return HFEngineClient(model_dir=str(tiny_model_dir), version=7)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def run_with_source(
    env_cfg: EnvConfig, engines: list[Any], model_dir: Path, seq_len: int,
    body: Callable[[VerifiersRolloutSource], Awaitable[Any]],
) -> Any:  # fmt: skip
    async def main() -> Any:
        async with build_rollout_source(
            env_cfg=env_cfg, engines=engines, model_path=str(model_dir), seq_len=seq_len
        ) as source:
            return await body(source)

    return asyncio.run(main())


def check_alignment(ep: Episode, version: int) -> None:
    n = len(ep.token_ids)
    assert n > 0 and len(ep.loss_mask) == len(ep.sampler_logprobs) == len(ep.token_versions) == n
    for m, lp, v in zip(ep.loss_mask, ep.sampler_logprobs, ep.token_versions, strict=True):
        assert math.isfinite(lp)
        if m:
            assert lp < 0 and v == version
        else:
            assert lp == 0.0 and v == -1
    assert not ep.loss_mask[0], "the prompt is never trained on"


def model_logprobs(model_dir: Path, token_ids: list[int]) -> list[float]:
    """log p(token_t | tokens_<t) under the model at temperature 1 (0.0 for the first token)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0].float()  # (T, V)
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]
    return [0.0, *logp.tolist()]


def test_reverse_text_episode(engine: HFEngineClient, tokenizer: Any, tiny_model_dir: Path) -> None:
    from reverse_text import lcs_ratio

    async def body(source: VerifiersRolloutSource) -> list[Episode]:
        assert source.num_examples == 20
        n_outputs = len(engine.outputs)
        episodes = [
            await source.run_episode(example_id=i, engine_key="0", sampling=SAMPLING) for i in range(3)
        ]
        # the source told renderers the prompt limit (seq_len) up front: no per-episode lookup
        assert source.gateway.num_model_list_requests == 0
        assert source.gateway.num_requests >= 3
        return [episodes, engine.outputs[n_outputs:], list(source._tasks[:3])]

    env_cfg = EnvConfig(id="reverse-text", args={"num_examples": 20, "seed": 1})
    episodes, outputs, tasks = run_with_source(env_cfg, [engine], tiny_model_dir, 512, body)
    for ep, out, task in zip(episodes, outputs, tasks, strict=True):
        assert ep.status == "ok", ep.error  # a bare end-of-turn answer is trained too
        check_alignment(ep, version=7)
        sampled = [t for t, m in zip(ep.token_ids, ep.loss_mask, strict=True) if m]
        assert sampled == out, "the trained tokens are exactly what the engine sampled"
        assert ep.metrics["sampled_tokens"] == len(out), "the length bias's unit: what the seat sampled"
        text = tokenizer.decode(ep.token_ids)
        assert text.startswith("<|im_start|>system\n") and task.data.text in text
        reply = tokenizer.decode([t for t in sampled if t != tokenizer.eos_token_id]).strip()
        assert ep.reward == pytest.approx(lcs_ratio(reply, task.data.text[::-1]))
        assert 0.0 <= ep.reward <= 1.0
        ref = model_logprobs(tiny_model_dir, ep.token_ids)
        for lp, want, m in zip(ep.sampler_logprobs, ref, ep.loss_mask, strict=True):
            if m:
                assert lp == pytest.approx(want, abs=1e-4)
    assert any(ep.status == "ok" for ep in episodes)


def test_calculator_episode_masks_tool_turns(
    engine: HFEngineClient, tokenizer: Any, tiny_model_dir: Path
) -> None:
    eos = tokenizer.eos_token_id

    async def body(source: VerifiersRolloutSource) -> tuple[Episode, Any]:
        task = source._tasks[2]
        first = [*tokenizer.encode(f"<calc>{task.data.expression}</calc>"), eos]
        final = [*tokenizer.encode(f"I get <answer>{task.data.answer}</answer>"), eos]
        engine.force_next(first)
        engine.force_next(final)
        sampling = SamplingParams(temperature=1.0, max_tokens=64)
        ep = await source.run_episode(example_id=2, engine_key="0", sampling=sampling)
        return ep, task, first, final

    env_cfg = EnvConfig(id="calculator", args={"num_examples": 5, "max_calls": 2})
    ep, task, first, final = run_with_source(env_cfg, [engine], tiny_model_dir, 1024, body)
    assert ep.status == "ok", ep.error
    assert ep.reward == 1.0
    assert ep.metrics["num_turns"] == 2 and ep.metrics["env/calculator_calls"] == 1.0
    check_alignment(ep, version=7)
    sampled = [t for t, m in zip(ep.token_ids, ep.loss_mask, strict=True) if m]
    assert sampled == first + final, "only the two policy turns are trained on"
    unsampled_text = tokenizer.decode([t for t, m in zip(ep.token_ids, ep.loss_mask, strict=True) if not m])
    assert f"<result>{task.data.answer}</result>" in unsampled_text, "the tool result is masked out"
    assert "<|im_start|>user" in unsampled_text and "<|im_start|>assistant" in unsampled_text
    ref = model_logprobs(tiny_model_dir, ep.token_ids)
    for lp, want, m in zip(ep.sampler_logprobs, ref, ep.loss_mask, strict=True):
        if m:
            assert lp == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize(("fn", "fragment"), [("raising_reward", "exploded"), ("nan_reward", "not finite"),
                                              ("none_reward", "")])  # fmt: skip
def test_reward_faults_are_error_statuses(
    engine: HFEngineClient, tiny_model_dir: Path, fn: str, fragment: str
) -> None:
    args = {"num_examples": 4, "task": {"rewards": {"lcs": {"fn": f"{FAULTY}:{fn}"}}}}

    async def body(source: VerifiersRolloutSource) -> Episode:
        engine.force_next([300, 301, 302, engine.model.config.eos_token_id])
        return await source.run_episode(example_id=0, engine_key="0", sampling=SAMPLING)

    ep = run_with_source(EnvConfig(id="reverse-text", args=args), [engine], tiny_model_dir, 512, body)
    assert ep.status == "error" and ep.reward is None
    assert ep.metrics["env_error"] == "reward" and fragment in ep.error


def test_empty_reply_is_trained_with_its_reward(engine: HFEngineClient, tiny_model_dir: Path) -> None:
    """An empty final reply is a legal action (an untrained player's usual answer): it is trained with
    its reward, not dropped as an error (a two-seat game used to lose every group this way)."""
    eos = engine.model.config.eos_token_id

    async def body(source: VerifiersRolloutSource) -> tuple[Episode, dict[str, float]]:
        engine.force_next([eos])
        ep = await source.run_episode(example_id=1, engine_key="0", sampling=SAMPLING)
        return ep, source.metrics()

    ep, metrics = run_with_source(
        EnvConfig(id="reverse-text", args={"num_examples": 4}), [engine], tiny_model_dir, 512, body
    )
    assert ep.status == "ok", ep.error
    assert ep.reward == 0.0
    assert [t for t, m in zip(ep.token_ids, ep.loss_mask, strict=True) if m] == [eos]
    assert metrics["env/episodes/ok"] == 1.0 and "env/errors/empty_completion" not in metrics


def test_prompt_that_does_not_fit_names_its_length(engine: HFEngineClient, tiny_model_dir: Path) -> None:
    """The first cause, not the symptom: a prompt over seq_len is refused by verifiers' client before
    any request; the episode's error says so with both lengths (it used to say 'empty completion')."""

    async def body(source: VerifiersRolloutSource) -> Episode:
        return await source.run_episode(example_id=0, engine_key="0", sampling=SAMPLING)

    seq_len = 24  # the reverse-text prompt is ~50 tokens
    ep = run_with_source(
        EnvConfig(id="reverse-text", args={"num_examples": 2}), [engine], tiny_model_dir, seq_len, body
    )
    assert ep.status == "error" and ep.metrics["env_error"] == "prompt_too_long", ep.error
    assert f"does not fit seq_len = {seq_len}" in ep.error and "tool schemas included" in ep.error


def test_truncated_at_seq_len(engine: HFEngineClient, tiny_model_dir: Path) -> None:
    async def body(source: VerifiersRolloutSource) -> Episode:
        return await source.run_episode(
            example_id=0, engine_key="0", sampling=SamplingParams(temperature=1.0, max_tokens=500)
        )

    seq_len = 80  # the reverse-text prompt is ~50 tokens
    ep = run_with_source(
        EnvConfig(id="reverse-text", args={"num_examples": 2}), [engine], tiny_model_dir, seq_len, body
    )
    assert ep.truncated and ep.overlong and len(ep.token_ids) <= seq_len
    assert engine.requests[-1]["sampling_params"]["max_new_tokens"] == seq_len - len(
        engine.requests[-1]["input_ids"]
    )


def test_cancel_aborts_the_engine_request(engine: HFEngineClient, tiny_model_dir: Path) -> None:
    async def body(source: VerifiersRolloutSource) -> Episode:
        aborts_before = len(engine.abort_log)
        task = asyncio.create_task(
            source.run_episode(
                example_id=0, engine_key="0", sampling=SamplingParams(temperature=1.0, max_tokens=3000)
            )
        )
        deadline = asyncio.get_running_loop().time() + 120
        while not engine.inflight:
            assert asyncio.get_running_loop().time() < deadline, "request never reached the engine"
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(engine.abort_log) == aborts_before + 1
        assert source.counts["cancelled"] == 1 and not source.gateway.sessions
        # the length bias's record: one trajectory, what the aborted request had sampled (engine key "0")
        (lengths,) = source.cancelled_lengths.values()
        assert list(source.cancelled_lengths) == ["0"] and len(lengths) == 1 and lengths[0] >= 0
        # the source keeps working after a cancel
        return await source.run_episode(example_id=1, engine_key="0", sampling=SAMPLING)

    ep = run_with_source(
        EnvConfig(id="reverse-text", args={"num_examples": 2}), [engine], tiny_model_dir, 4096, body
    )
    assert ep.status in ("ok", "error") and len(ep.token_ids) > 0


def _start_inference(model_dir: Path, work: Path) -> tuple[str, subprocess.Popen]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = work / "inference.toml"
    cfg.write_text(
        f'backend = "torch"\nseq_len = 1024\noutput_dir = "{work}"\n[model]\npath = "{model_dir}"\n'
        f"[server]\nport = {port}\n[engine]\nmax_running_requests = 8\nnum_threads = 1\n"
    )
    log = (work / "inference.log").open("w")
    exe = Path(sys.executable).parent / "inference"
    proc = subprocess.Popen(
        [str(exe), "@", str(cfg)], stdout=log, stderr=subprocess.STDOUT, env={**os.environ}
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, (work / "inference.log").read_text()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("inference did not become healthy")


@pytest.mark.slow
def test_episode_against_embedded_engine_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    from prime_async.inference.client import HttpEngineClient

    url, proc = _start_inference(tiny_model_dir, tmp_path)
    try:

        async def main() -> list[Episode]:
            client = HttpEngineClient(url)
            async with build_rollout_source(
                env_cfg=EnvConfig(id="calculator", args={"num_examples": 4}),
                engines=[client],
                model_path=str(tiny_model_dir),
                seq_len=1024,
            ) as source:
                version = await client.weight_version()
                eps = await asyncio.gather(
                    *(
                        source.run_episode(example_id=i, engine_key=f"g{i}", sampling=SAMPLING)
                        for i in range(4)
                    )
                )
            await client.aclose()
            return eps, version

        episodes, version = asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(30)
    for ep in episodes:
        assert ep.status in ("ok", "error"), ep.error
        if ep.status == "ok":
            check_alignment(ep, version=version)
            assert ep.reward in (0.0, 1.0)
    assert any(ep.status == "ok" for ep in episodes)


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["subprocess", "env_server"])
def test_null_harness_runners(engine: HFEngineClient, tiny_model_dir: Path, runner: str) -> None:
    """verifiers' own `null` harness program, in this process's env or in verifiers' env server process
    (needs the program's `uv sync --script` bootstrap: package index or warm uv cache)."""

    async def body(source: VerifiersRolloutSource) -> Episode:
        engine.force_next([300, 301, 302, engine.model.config.eos_token_id])
        return await source.run_episode(example_id=0, engine_key="0", sampling=SAMPLING)

    env_cfg = EnvConfig(id="reverse-text", runner=runner, args={"num_examples": 2})
    ep = run_with_source(env_cfg, [engine], tiny_model_dir, 512, body)
    assert ep.status == "ok", ep.error
    check_alignment(ep, version=7)
    assert [t for t, m in zip(ep.token_ids, ep.loss_mask, strict=True) if m] == [
        300,
        301,
        302,
        engine.model.config.eos_token_id,
    ]


def test_inprocess_runner_needs_no_network(
    engine: HFEngineClient, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every non-loopback HTTP(S) connection goes to a closed port: the default runner still works (the
    `null` harness runners fail here, on their `uv sync --script` bootstrap)."""
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")

    async def body(source: VerifiersRolloutSource) -> Episode:
        engine.force_next([300, 301, 302, engine.model.config.eos_token_id])
        return await source.run_episode(example_id=0, engine_key="0", sampling=SAMPLING)

    ep = run_with_source(
        EnvConfig(id="calculator", args={"num_examples": 2}), [engine], tiny_model_dir, 512, body
    )
    assert ep.status == "ok", ep.error
