"""Weights over torch.distributed (gloo) into a real embedded engine process, against the filesystem path.

The test process is rank 0 of the weight process group (as trainer rank 0 is in a run): it joins with
`weight_group.join_weight_group` while the engine joins through `/init_weights_update_group`, then
broadcasts each version in several buckets while `/update_weights_from_distributed` receives them. For
every version the engine's logprobs (fixed sampling seed) must equal those it gives after loading the same
tensors from a broadcast directory (`/update_weights_from_disk`), and generation paused in each mode
continues across the update with per-token version spans. The shared-memory path (`weights.transport =
"shared"`, `/update_weights_from_tensor`) is checked the same way against the filesystem path.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from prime_async.weights.process_group import (
    join_weight_group,
    leave_weight_group,
    metas_of,
    plan_buckets,
    send_bucket,
)
from prime_async.weights.writer import BroadcastWriter
from proc_helpers import free_port, start_embedded_engine

PROMPT = [5, 17, 42, 99, 3, 250, 7]
pytestmark = pytest.mark.timeout(1200)  # the engine process starts in ~30 s, in minutes on a loaded machine


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    yield from _engine(tiny_model_dir, tmp_path_factory.mktemp("dist_engine"), device="cpu")


@pytest.fixture(scope="module")
def cuda_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    yield from _engine(tiny_model_dir, tmp_path_factory.mktemp("dist_engine_cuda"), device="cuda")


def _engine(tiny_model_dir: Path, work: Path, *, device: str):
    config = (
        f'backend = "torch"\nseq_len = 512\noutput_dir = "{work}"\n[model]\npath = "{tiny_model_dir}"\n'
        f'[engine]\nmax_running_requests = 8\nnum_threads = 1\ndevice = "{device}"\n'
    )
    url, proc = start_embedded_engine(config, work, timeout_s=900)
    try:
        yield url, work
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def version_state(model_dir: Path, version: int) -> dict[str, torch.Tensor]:
    """Deterministic weights of `version`: the tiny model plus seeded noise."""
    base = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(version)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in base.items()}


def generate(url: str, max_new_tokens: int = 8, seed: int = 1) -> dict:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0, "sampling_seed": seed,
                            "ignore_eos": True},
        "return_logprob": True,
    }  # fmt: skip
    resp = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def post(url: str, route: str, payload: dict, *, expect: int = 200) -> dict:
    resp = httpx.post(f"{url}{route}", json=payload, timeout=120)
    assert resp.status_code == expect, f"{route}: {resp.status_code} {resp.text}"
    return resp.json()


class Rank0:
    """The test process as rank 0 of a weight process group with the engine as rank 1."""

    def __init__(self, url: str, group_name: str, backend: str = "gloo"):
        self.url, self.group_name, self.backend = url, group_name, backend
        self.device = torch.device("cuda" if backend == "nccl" else "cpu")
        port = free_port()
        result: dict = {}

        def join() -> None:
            result["pg"] = join_weight_group(
                backend=backend, master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
                group_name=group_name, timeout_s=120,
            )  # fmt: skip

        thread = threading.Thread(target=join)
        thread.start()
        answer = post(url, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": group_name, "backend": backend,
        })  # fmt: skip
        thread.join(timeout=120)
        assert answer["success"] is True, answer
        self.pg = result["pg"]

    def send(self, state: dict[str, torch.Tensor], version: int, *, bucket_bytes: int, flush: bool) -> int:
        """Broadcast `state` bucket by bucket while the engine receives; the last bucket carries the label."""
        buckets = plan_buckets(metas_of(state), bucket_bytes)
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            sender = threading.Thread(target=send_bucket, args=(self.pg, state, bucket, self.device))
            sender.start()
            payload = {
                "names": [m.name for m in bucket], "dtypes": [m.dtype for m in bucket],
                "shapes": [m.shape for m in bucket], "group_name": self.group_name,
                "flush_cache": flush and last,
            }  # fmt: skip
            if last:
                payload["weight_version"] = str(version)
            answer = post(self.url, "/update_weights_from_distributed", payload)
            sender.join(timeout=60)
            assert answer["success"] is True, answer
        return len(buckets)

    def close(self) -> None:
        post(self.url, "/destroy_weights_update_group", {"group_name": self.group_name})
        leave_weight_group(self.pg)


def logprobs(answer: dict) -> list[float]:
    return [item[0] for item in answer["meta_info"]["output_token_logprobs"]]


def test_distributed_versions_equal_filesystem(engine, tiny_model_dir: Path) -> None:
    check_versions_equal_filesystem(engine, tiny_model_dir, "gloo")


@pytest.mark.gpu
def test_nccl_versions_equal_filesystem(cuda_engine, tiny_model_dir: Path) -> None:
    """The same on a CUDA engine with NCCL (run by scripts/gpu_smoke.sh when a GPU is there)."""
    check_versions_equal_filesystem(cuda_engine, tiny_model_dir, "nccl")


def check_versions_equal_filesystem(engine, tiny_model_dir: Path, backend: str) -> None:
    url, work = engine
    rank0 = Rank0(url, f"test-equal-{backend}", backend)
    publisher = BroadcastWriter(
        output_dir=work, model_config=_config(tiny_model_dir), source_dir=tiny_model_dir, keep_last=2
    )
    try:
        for version in (1, 2, 3):
            state = version_state(tiny_model_dir, version)
            num_buckets = rank0.send(state, version, bucket_bytes=200_000, flush=True)
            assert num_buckets > 1  # the bucket bound splits the tiny model
            via_group = generate(url)
            assert via_group["meta_info"]["weight_version"] == str(version)
            path = publisher.publish(state, version)
            post(url, "/update_weights_from_disk", {"model_path": str(path), "weight_version": str(version)})
            via_disk = generate(url)
            assert via_group["output_ids"] == via_disk["output_ids"]
            assert logprobs(via_group) == logprobs(via_disk)  # the same weights, bit for bit
    finally:
        rank0.close()


def test_shared_versions_equal_filesystem(engine, tiny_model_dir: Path) -> None:
    """`weights.transport = "shared"` on CPU: versions in POSIX shared memory, copied by the engine."""
    check_shared_equals_filesystem(engine, tiny_model_dir, torch.device("cpu"))


@pytest.mark.gpu
def test_shared_cuda_versions_equal_filesystem(cuda_engine, tiny_model_dir: Path) -> None:
    """The same with the test process's buffer on the GPU, lent to a CUDA engine as IPC handle fields
    (engine and 'trainer' on one GPU: what NCCL refuses)."""
    check_shared_equals_filesystem(cuda_engine, tiny_model_dir, torch.device("cuda"))


def check_shared_equals_filesystem(engine, tiny_model_dir: Path, device: torch.device) -> None:
    from prime_async.weights.shared_memory import SharedStore
    from prime_async.weights.shared_wire import SHARED_LOAD_FORMAT, encode_share

    url, work = engine
    store = SharedStore(device, keep=2)
    publisher = BroadcastWriter(
        output_dir=work / device.type, model_config=_config(tiny_model_dir), source_dir=tiny_model_dir,
        keep_last=2,
    )  # fmt: skip
    try:
        for version in (21, 22, 23):
            state = version_state(tiny_model_dir, version)
            store.put(state, version)
            [share] = store.lend(version, 1)
            assert (share.cuda is not None) == (device.type == "cuda")
            post(url, "/update_weights_from_tensor", {
                "serialized_named_tensors": [encode_share(share)], "load_format": SHARED_LOAD_FORMAT,
                "weight_version": str(version),
            })  # fmt: skip
            store.give_back(version)
            via_shared = generate(url)
            assert via_shared["meta_info"]["weight_version"] == str(version)
            path = publisher.publish(state, version)
            post(url, "/update_weights_from_disk", {"model_path": str(path), "weight_version": str(version)})
            via_disk = generate(url)
            assert via_shared["output_ids"] == via_disk["output_ids"]
            assert logprobs(via_shared) == logprobs(via_disk)  # the same weights, bit for bit
    finally:
        store.close()


def test_shared_bad_requests_are_refused_and_weights_kept(engine, tiny_model_dir: Path) -> None:
    """A pickle (SGLang's format), a version missing tensors, a tensor of the wrong shape, a segment the
    trainer dropped: 400, and the engine serves what it served."""
    import base64
    import pickle

    from prime_async.weights.shared_memory import SharedStore
    from prime_async.weights.shared_wire import SHARED_LOAD_FORMAT, encode_share

    url, _ = engine
    before = generate(url)
    pickled = base64.b64encode(pickle.dumps([("model.norm.weight", torch.zeros(3))])).decode()
    answer = post(url, "/update_weights_from_tensor", {"serialized_named_tensors": [pickled]}, expect=400)
    assert "never unpickles" in str(answer), answer

    def payload(share) -> dict:
        return {"serialized_named_tensors": [encode_share(share)], "load_format": SHARED_LOAD_FORMAT,
                "weight_version": "99"}  # fmt: skip

    store = SharedStore(torch.device("cpu"), keep=1)
    try:
        store.put({"model.norm.weight": torch.zeros(3)}, 97)
        [partial] = store.lend(97, 1)
        answer = post(url, "/update_weights_from_tensor", payload(partial), expect=400)
        assert "missing ['model.embed_tokens.weight'" in answer["message"], answer  # a whole version only
        store.put({**version_state(tiny_model_dir, 98), "model.norm.weight": torch.zeros(3)}, 98)
        [wrong_shape] = store.lend(98, 1)
        answer = post(url, "/update_weights_from_tensor", payload(wrong_shape), expect=400)
        assert "model.norm.weight has shape (3,)" in answer["message"], answer
        store.put(version_state(tiny_model_dir, 99), 99)
        [dropped] = store.lend(99, 1)
        store.give_back(99)
        store.put(version_state(tiny_model_dir, 100), 100)  # keep = 1: v99's segment is unlinked
        answer = post(url, "/update_weights_from_tensor", payload(dropped), expect=400)
        assert "does not exist" in answer["message"], answer
    finally:
        store.close()
    after = generate(url)
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]
    assert logprobs(after) == logprobs(before)


@pytest.mark.parametrize(("mode", "version"), [("retract", 10), ("in_place", 11), ("abort", 12)])
def test_update_in_flight_each_pause_mode(engine, tiny_model_dir: Path, mode: str, version: int) -> None:
    url, _ = engine
    rank0 = Rank0(url, f"test-inflight-{mode}")
    try:

        async def scenario() -> dict:
            async with httpx.AsyncClient(timeout=120) as client:
                body = {
                    "input_ids": PROMPT, "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 400, "temperature": 1.0, "ignore_eos": True},
                }  # fmt: skip
                running = asyncio.create_task(client.post(f"{url}/generate", json=body))
                while (await client.get(f"{url}/get_server_info")).json()["num_running_reqs"] == 0:
                    await asyncio.sleep(0.01)
                await client.post(f"{url}/pause_generation", json={"mode": mode})
                state = version_state(tiny_model_dir, version)
                await asyncio.to_thread(
                    rank0.send, state, version, bucket_bytes=1 << 30, flush=mode != "in_place"
                )
                await client.post(f"{url}/continue_generation", json={})
                return (await running).json()

        answer = asyncio.run(scenario())
        spans = answer["meta_info"]["weight_versions"]
        if mode == "abort":
            assert answer["meta_info"]["finish_reason"]["type"] == "abort"
        else:
            assert answer["meta_info"]["finish_reason"]["type"] == "length"
            assert len(spans) >= 2 and spans[0]["version"] != str(version)  # generated across the update
            assert spans[-1]["version"] == str(version) and spans[-1]["end"] == 400
    finally:
        rank0.close()


def test_bad_requests_are_refused_and_weights_kept(engine, tiny_model_dir: Path) -> None:
    url, _ = engine
    before = generate(url)
    answer = post(url, "/update_weights_from_distributed",
                  {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "missing"},
                  expect=400)  # fmt: skip
    assert "not initialized" in answer["message"]
    rank0 = Rank0(url, "test-bad")
    try:
        bad = {"model.norm.weight": torch.zeros(3)}  # wrong shape: received, then refused
        sender = threading.Thread(
            target=send_bucket, args=(rank0.pg, bad, metas_of(bad), torch.device("cpu"))
        )
        sender.start()
        answer = post(url, "/update_weights_from_distributed", {
            "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[3]], "group_name": "test-bad",
            "weight_version": "99",
        }, expect=400)  # fmt: skip
        sender.join(timeout=60)
        assert not sender.is_alive()  # rank 0 was never left blocked
        assert "shape" in answer["message"]
    finally:
        rank0.close()
    after = generate(url)
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]
    assert logprobs(after) == logprobs(before)
    post(url, "/destroy_weights_update_group", {"group_name": "test-bad"}, expect=400)


def _config(model_dir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)
