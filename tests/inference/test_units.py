"""Unit tests of the inference pieces that need no engine process: config, launcher command lines,
version spans, client parsing, sampler truncation, and API-key protection (in-process app)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch

from prime_async.config.inference import InferenceConfig
from prime_async.inference.api import version_spans
from prime_async.inference.client import parse_generate, parse_version, token_versions
from prime_async.inference.sampler import SamplingParams, _truncate, sample
from prime_async.inference.sglang_launcher import build_launch_specs

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "path", sorted(ROOT.glob("configs/*/inference*.toml")), ids=lambda p: f"{p.parent.name}-{p.name}"
)
def test_inference_tomls_parse(path):
    with path.open("rb") as f:
        InferenceConfig.model_validate(tomllib.load(f))


def test_config_rejects_exposed_server_without_key_and_unknown_keys():
    with pytest.raises(ValueError, match="api_key"):
        InferenceConfig.model_validate({"server": {"host": "0.0.0.0"}})
    InferenceConfig.model_validate({"server": {"host": "0.0.0.0", "api_key": "k"}})
    with pytest.raises(ValueError, match="max_running_requests"):
        InferenceConfig.model_validate({"engine": {"max_running_requests": 0}})
    with pytest.raises(ValueError, match="extra"):
        InferenceConfig.model_validate({"engine": {"max_runing_requests": 4}})
    assert all(f.description for f in InferenceConfig.model_fields.values())


def test_launcher_command_lines_for_two_engines():
    cfg = InferenceConfig.model_validate(
        {
            "backend": "sglang",
            "seq_len": 8192,
            "weight_version": 3,
            "model": {"path": "/m/qwen", "dtype": "bfloat16"},
            "server": {"port": 31000, "api_key": "sek"},
            "sglang": {"num_engines": 2, "tp": 2, "mem_fraction": 0.6, "max_running_requests": 128,
                       "extra_args": ["--disable-radix-cache"]},
        }
    )  # fmt: skip
    specs = build_launch_specs(cfg, environ={})  # a machine where this process sees every GPU
    assert [s.url for s in specs] == ["http://127.0.0.1:31000", "http://127.0.0.1:31001"]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1", "2,3"]
    argv = specs[1].argv
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]

    def flag(name):
        return argv[argv.index(name) + 1]

    assert flag("--model-path") == "/m/qwen" and flag("--port") == "31001" and flag("--host") == "127.0.0.1"
    assert flag("--tp-size") == "2" and flag("--dp-size") == "1" and flag("--mem-fraction-static") == "0.6"
    assert flag("--context-length") == "8192" and flag("--weight-version") == "3"
    assert (
        flag("--max-running-requests") == "128"
        and flag("--api-key") == "sek"
        and flag("--dtype") == "bfloat16"
    )
    assert "--skip-server-warmup" in argv and argv[-1] == "--disable-radix-cache"


def test_launcher_gpu_ids_index_the_devices_this_process_sees():
    """Under `rl` the inference process gets CUDA_VISIBLE_DEVICES = gpus.inference; an engine's own value
    replaces it (it does not narrow it), so the launcher must translate, or engines land on GPUs 0..n-1."""
    cfg = InferenceConfig.model_validate({"backend": "sglang", "sglang": {"num_engines": 2, "tp": 2}})
    specs = build_launch_specs(cfg, environ={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["4,5", "6,7"]
    specs = build_launch_specs(cfg, environ={})
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1", "2,3"]
    with pytest.raises(ValueError, match="device index 2 is not among the 2 devices"):
        build_launch_specs(cfg, environ={"CUDA_VISIBLE_DEVICES": "4,5"})


def test_launcher_rejects_too_few_gpus():
    cfg = InferenceConfig.model_validate({"backend": "sglang", "sglang": {"num_engines": 2, "gpu_ids": [0]}})
    with pytest.raises(ValueError, match="gpu_ids"):
        build_launch_specs(cfg)


def test_version_spans_and_client_expansion_roundtrip():
    versions = ["1", "1", "2", "2", "2", "3"]
    spans = version_spans(versions)
    assert spans == [
        {"version": "1", "start": 0, "end": 2},
        {"version": "2", "start": 2, "end": 5},
        {"version": "3", "start": 5, "end": 6},
    ]
    assert token_versions({"weight_versions": spans}, 6) == [1, 1, 2, 2, 2, 3]
    assert token_versions({"weight_version": "4"}, 2) == [4, 4]
    assert version_spans([]) == [] and parse_version("default") == 0
    with pytest.raises(ValueError):
        token_versions({"weight_versions": spans[:2]}, 6)


def test_parse_generate_checks_alignment():
    body = {
        "output_ids": [5, 6],
        "meta_info": {"id": "r", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3,
                      "weight_version": "2", "weight_versions": [{"version": "2", "start": 0, "end": 2}],
                      "output_token_logprobs": [[-0.5, 5, None], [-1.5, 6, None]]},
    }  # fmt: skip
    res = parse_generate(body, None)
    assert (
        res.output_logprobs == [-0.5, -1.5] and res.token_versions == [2, 2] and res.finish_type == "length"
    )
    body["meta_info"]["output_token_logprobs"][1][1] = 7
    with pytest.raises(ValueError, match="align"):
        parse_generate(body, None)


def test_truncation_keeps_top_k_top_p_min_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3)
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.8), SamplingParams(min_p=0.5)]
    kept = _truncate(probs, params) > 0
    assert kept.tolist() == [
        [True, True, False, False],
        [True, True, False, False],
        [True, True, False, False],
    ]


def test_sampler_logprobs_are_untruncated_and_seeded_rows_reproducible():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, sampling_seed=7),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=2.0, top_p=0.5),
    ]
    gens = [None, torch.Generator().manual_seed(7), None, None]
    tokens, logprobs = sample(logits, params, gens, torch.Generator().manual_seed(1))
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[2] in logits[2].topk(3).indices.tolist()
    for i, p in enumerate(params):
        ref = torch.log_softmax(logits[i] / (p.temperature or 1.0), -1)[tokens[i]]
        assert logprobs[i] == pytest.approx(float(ref), abs=1e-6)
    again, _ = sample(logits[1:2], params[1:2], [torch.Generator().manual_seed(7)], torch.Generator())
    assert again[0] == tokens[1]
    # empirical distribution of a plain sample matches softmax (inverse-CDF draw is unbiased)
    row = torch.tensor([[0.0, 1.0, 2.0]])
    g = torch.Generator().manual_seed(3)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(row, [SamplingParams()], [None], g)[0][0]] += 1
    assert torch.allclose(counts / 3000, torch.softmax(row[0], -1), atol=0.03)


def test_api_key_protects_admin_routes(tiny_model_dir):
    from fastapi.testclient import TestClient

    from prime_async.inference.engine import Engine
    from prime_async.inference.engine_settings import EngineSettings, SlotSettings
    from prime_async.inference.server import build_app

    engine = Engine(
        EngineSettings(model_path=str(tiny_model_dir), slots=SlotSettings(max_running_requests=4, max_len=64))
    )
    with TestClient(build_app(engine, api_key="sek")) as client:
        assert client.get("/health").status_code == 200
        assert client.post("/pause_generation", json={"mode": "abort"}).status_code == 401
        assert client.post("/generate", json={"input_ids": [5]}).status_code == 401
        auth = {"Authorization": "Bearer sek"}
        r = client.post(
            "/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 2}}, headers=auth
        )
        assert r.status_code == 200 and len(r.json()["output_ids"]) <= 2


def test_kv_cache_compaction_outside_inference_mode(tiny_model_dir) -> None:
    """Compaction runs on abort/pause paths outside the inference-mode forward; the cache tensors
    were made inside it, and an in-place write to them outside inference mode used to raise."""
    import torch

    from prime_async.inference.model_runner import ModelRunner

    runner = ModelRunner(
        model_path=str(tiny_model_dir), dtype="float32", device="cpu", num_slots=2, max_len=64, chunk=16
    )
    with torch.inference_mode():
        runner.ensure_capacity(32)
    runner.move_slot(0, 1, 8)  # outside inference mode
    torch.testing.assert_close(runner.k_cache[0][1, :, :8], runner.k_cache[0][0, :, :8])


@pytest.fixture(scope="module")
def packable_model_dir(tmp_path_factory) -> Path:
    """The tiny model's architecture at hidden size 512: every weight is big enough to be packed."""
    from prime_async.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("packable"), hidden_size=512, num_heads=8)


MODEL_FIXTURES = {"packable": "packable_model_dir", "tiny": "tiny_model_dir", "moe": "tiny_moe_model_dir"}


@pytest.mark.parametrize(
    ("model", "kernels"),
    [("packable", "packed"), ("packable", "dense"), ("tiny", "packed"), ("moe", "packed")],
)
def test_runner_logprobs_match_hf_forward_at_every_batch_size(request, model, kernels) -> None:
    """Prefill, then decode steps over 4, 3, 2 and 1 running slots (packed projections serve > 2 rows,
    the dense weights <= 2): every position's log-softmax equals an HF forward of the whole sequence.
    The tiny model's weights are all below the packing threshold, so nothing of it is packed. The MoE
    model's experts are routed as transformers routes them: the same logits, and the same experts."""
    from prime_async.inference.linear import packing_available
    from prime_async.inference.model_runner import ModelRunner

    torch.set_num_threads(1)
    model_dir = request.getfixturevalue(MODEL_FIXTURES[model])
    runner = ModelRunner(
        model_path=str(model_dir), dtype="float32", device="cpu", num_slots=4, max_len=64, chunk=16,
        kernels=kernels,
    )  # fmt: skip
    onednn = packing_available(torch.device("cpu"), torch.float32)
    packs = model == "packable" and kernels == "packed" and onednn
    names = ("qkv", "o") if model == "moe" else ("qkv", "o", "gate_up", "down")
    projections = [runner.lm_head, *(lw[k] for lw in runner.layers for k in names)]
    assert [p.packed is not None for p in projections] == [packs] * len(projections)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, runner.vocab_size, (n,), generator=g).tolist() for n in (20, 17, 14, 11)]
    prompt_lens = [7, 5, 9, 3]
    with torch.inference_mode():
        refs = [runner.model(torch.tensor([s])).logits[0].log_softmax(-1) for s in seqs]
        worst = 0.0
        got = runner.prefill([s[:n] for s, n in zip(seqs, prompt_lens, strict=True)], [0, 1, 2, 3])
        for slot, n in enumerate(prompt_lens):
            worst = max(worst, float((got[slot].log_softmax(-1) - refs[slot][n - 1]).abs().max()))
        pos = list(prompt_lens)
        for batch in (4, 4, 3, 3, 2, 2, 1, 1):  # slots 0..batch-1 keep decoding, as after compaction
            ids = torch.tensor([seqs[b][pos[b]] for b in range(batch)])
            positions = torch.tensor(pos[:batch])
            got = runner.decode(ids, positions, int(positions.max()) + 1).log_softmax(-1)
            for b in range(batch):
                worst = max(worst, float((got[b] - refs[b][pos[b]]).abs().max()))
                pos[b] += 1
    assert worst < 1e-4


def test_runner_routes_are_the_experts_transformers_picks(tiny_moe_model_dir: Path) -> None:
    """`take_routes` after a prefill and a decode step: per token and layer, the top-k experts of
    transformers. own router on the whole sequence; each forward.s routes are taken once."""
    from prime_async.inference.model_runner import ModelRunner

    runner = ModelRunner(
        model_path=str(tiny_moe_model_dir), dtype="float32", device="cpu", num_slots=2, max_len=64, chunk=16
    )
    seq = torch.randint(3, runner.vocab_size, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    picked = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: picked.append(out[2]))
        for layer in runner.model.model.layers
    ]
    with torch.inference_mode():
        runner.model(torch.tensor([seq]))
        runner.prefill([seq[:11]], [0])
        prompt_routes = runner.take_routes()
        runner.decode(torch.tensor([seq[11]]), torch.tensor([11]), 12)
        decode_routes = runner.take_routes()
    for h in hooks:
        h.remove()
    expected = torch.stack(picked, dim=1)  # (12, layers, k)
    assert prompt_routes.shape == (11, 3, 2) and decode_routes.shape == (1, 3, 2)
    got = torch.cat([prompt_routes, decode_routes])
    assert torch.equal(got.sort(-1).values, expected.sort(-1).values)
    assert runner.take_routes() is None


def test_client_reports_unreachable_engine_as_engine_unavailable():
    """No httpx exception type leaves the client: the orchestrator recognises outages by EngineUnavailable."""
    import asyncio
    import socket

    from prime_async.engine_api import EngineUnavailable
    from prime_async.inference.client import HttpEngineClient

    with socket.socket() as s:  # a port nobody listens on once the socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def go():
        async with HttpEngineClient(f"http://127.0.0.1:{port}") as client:
            for call in (
                lambda: client.generate([1, 2], {"max_new_tokens": 1}),
                lambda: client.pause_generation("retract"),
                lambda: client.update_weights_from_disk("/x", 1, flush_cache=True),
                client.weight_version,
            ):
                with pytest.raises(EngineUnavailable, match=f"127.0.0.1:{port}"):
                    await call()
            assert await client.health() is False

    asyncio.run(go())


def test_sampling_params_convert_to_sglang_and_vllm_names():
    from prime_async.engine_api import SamplingParams

    p = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=12)
    assert p.to_sglang() == {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 12}
    assert p.to_vllm() == {"temperature": 0.7, "top_p": 0.9, "max_tokens": 12}
    assert "max_new_tokens" not in SamplingParams().to_sglang()  # no limit: the gateway clamps to seq_len
