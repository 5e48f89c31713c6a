"""The shared-memory weight path (`weights.transport = "shared"`), its parts on CPU:

- the wire: a SharedVersion (CPU segment or CUDA IPC fields) survives JSON and the control channel's
  msgpack unchanged, and a malformed one is refused before anything is mapped;
- CUDA IPC handles field by field: torch's `reduce_tensor` arguments -> our struct -> the arguments
  `rebuild_cuda_tensor` gets in the engine, the trainer's GPU found by UUID under another local index
  (a spy stands in for the GPU), and refused when the engine cannot see that GPU;
- the trainer's store in POSIX shared memory: what the engine maps equals what was put, a lent version is
  kept until it is given back, segments are unlinked, a dead trainer's segments are swept;
- each side's device share (`mem_fraction`) and the refusals of `rl` where the path cannot work.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import msgspec
import pytest
import torch

from prime_async.config.loader import ConfigError, load_config
from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.config.placement import use_shared_weights
from prime_async.config.rl import RLConfig
from prime_async.config.sft import SFTConfig
from prime_async.utils.mem_fraction import apply_mem_fraction
from prime_async.weights import shared_memory
from prime_async.weights.control import GiveBack, Lend, Reply, decode, encode
from prime_async.weights.shared_memory import SharedStore, args_from_ipc, ipc_from_args, open_share, shm_dir
from prime_async.weights.shared_wire import (
    ALIGN,
    CudaIpc,
    SharedTensor,
    SharedVersion,
    decode_share,
    encode_share,
    layout,
)

IPC = CudaIpc(
    device_uuid="GPU-1234", handle=b"\x00\xffhandle\x01" * 7, storage_size_bytes=4096,
    storage_offset_bytes=512, ref_counter_handle=b"/torch_ref\x00", ref_counter_offset=3,
    event_handle=b"\x07event", event_sync_required=True,
)  # fmt: skip


def share(**fields) -> SharedVersion:
    tensors, nbytes = layout([("w", "bfloat16", [3, 5]), ("b", "float32", [7])])
    base = {"version": 4, "host": "h", "nbytes": nbytes, "tensors": tensors, "segment": "/dev/shm/x"}
    return SharedVersion(**{**base, **fields})


def test_layout_aligns_every_tensor_and_bounds_the_buffer() -> None:
    tensors, nbytes = layout([("a", "float32", [3]), ("b", "bfloat16", [300]), ("c", "int64", [])])
    assert [t.offset for t in tensors] == [0, ALIGN, 4 * ALIGN]  # b: 600 bytes, rounded up to 768
    assert nbytes == 5 * ALIGN


@pytest.mark.parametrize("fields", [{}, {"segment": None, "cuda": IPC}])
def test_share_round_trips_through_json_and_the_control_channel(fields: dict) -> None:
    original = share(**fields)
    assert decode_share(encode_share(original)) == original
    reply = Reply(9, True, "done", shares=[original, original])
    for msg in (reply, Lend(3, 4, 2), GiveBack(5, 4)):
        assert decode(encode(msg)) == msg
    assert decode_share(encode_share(original).encode()).cuda == fields.get("cuda")


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"segment": None}, "exactly one of"),
        ({"cuda": IPC}, "exactly one of"),
        ({"tensors": [SharedTensor("w", "float32", [4], 8)]}, "not a multiple"),
        ({"tensors": [SharedTensor("w", "float32", [4096], 0)]}, "past the buffer"),
        ({"tensors": [SharedTensor("w", "complex64", [1], 0)]}, "dtype 'complex64'"),
        ({"tensors": [SharedTensor("w", "float32", [-1, 2], 0)]}, "negative dimension"),
    ],
)
def test_malformed_shares_are_refused(fields: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        decode_share(encode_share(share(**fields)))


def test_non_json_is_refused() -> None:
    with pytest.raises(ValueError, match="malformed"):
        decode_share(b"\x80\x04pickle")


def reduce_args(device: int) -> tuple:
    """What `reduce_tensor` returns for a flat uint8 CUDA buffer of 1024 bytes (its argument order)."""
    return (torch.Tensor, torch.Size([1024]), (1,), 0, torch.storage.TypedStorage, torch.uint8, device,
            IPC.handle, IPC.storage_size_bytes, IPC.storage_offset_bytes, False, IPC.ref_counter_handle,
            IPC.ref_counter_offset, IPC.event_handle, IPC.event_sync_required)  # fmt: skip


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """A spy machine with GPUs GPU-a (index 0) and GPU-1234 (index 1); records rebuild_cuda_tensor calls."""
    import torch.multiprocessing.reductions as reductions

    uuids = ["GPU-a", "GPU-1234"]

    class Props:
        def __init__(self, i: int):
            self.uuid = uuids[i]

    calls: list[tuple] = []

    def rebuild(*args):
        calls.append(args)
        return torch.zeros(args[1][0], dtype=torch.uint8)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(torch.cuda, "get_device_properties", Props)
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    return calls


def test_cuda_ipc_fields_reach_rebuild_on_the_gpu_found_by_uuid(two_gpus: list[tuple]) -> None:
    ipc = ipc_from_args(reduce_args(device=1))  # the trainer's GPU is its cuda:1 = GPU-1234
    assert ipc == IPC
    wire = decode_share(encode_share(share(segment=None, cuda=ipc, nbytes=1024, host=socket.gethostname())))
    assert args_from_ipc(wire.cuda, 1024, 1) == reduce_args(1)
    with open_share(wire) as tensors:  # rebuilt on the engine's index of GPU-1234, then viewed
        assert tensors["w"].shape == (3, 5) and tensors["w"].dtype == torch.bfloat16
    assert two_gpus == [reduce_args(1)]


def test_an_engine_that_cannot_see_the_trainers_gpu_refuses(two_gpus: list[tuple]) -> None:
    wire = share(
        segment=None, cuda=msgspec.structs.replace(IPC, device_uuid="GPU-other"), host=socket.gethostname()
    )
    with pytest.raises(ValueError, match="GPU-other is not visible to this engine"), open_share(wire):
        pass
    assert two_gpus == []


def test_a_share_of_another_host_is_refused() -> None:
    with pytest.raises(ValueError, match="lives on host 'elsewhere'"), open_share(share(host="elsewhere")):
        pass


def state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        "b": torch.randn(7, generator=gen),
        "empty": torch.zeros(0, 4),
    }


def segments(store: SharedStore) -> list[str]:
    return sorted(p.name for p in shm_dir().glob(f"{store.prefix}-*"))


def test_store_lends_copies_keeps_the_lent_version_and_unlinks() -> None:
    store = SharedStore(torch.device("cpu"), keep=2)
    try:
        first = state(1)
        store.put(first, 1)
        first["b"] += 1  # the trainer's tensors change after put: the lent version does not
        [lent] = store.lend(1, 1)
        wire = decode_share(encode_share(lent))
        with open_share(wire) as tensors:
            assert torch.equal(tensors["w"], state(1)["w"]) and torch.equal(tensors["b"], state(1)["b"])
            assert tensors["empty"].shape == (0, 4)
        store.put(state(2), 2)
        store.put(state(3), 3)
        assert store.versions() == [1, 2, 3]  # 1 is lent: kept beyond keep = 2
        assert segments(store) == [f"{store.prefix}-v{v}" for v in (1, 2, 3)]
        inode = (shm_dir() / f"{store.prefix}-v1").stat().st_ino
        store.give_back(1)
        assert store.versions() == [2, 3]  # v1's segment is the spare now: no description finds it
        assert segments(store) == [f"{store.prefix}-{n}" for n in ("spare", "v2", "v3")]
        with pytest.raises(ValueError, match="does not exist"), open_share(wire):
            pass
        with pytest.raises(ValueError, match="cannot lend version 1: versions held: \\[2, 3\\]"):
            store.lend(1, 1)
        store.lend(2, 1)
        store.lend(3, 1)  # a new lend ends the previous lease
        store.put(state(4), 4)  # into the spare (v1's pages), v2 becomes the spare
        assert store.versions() == [3, 4]
        assert (shm_dir() / f"{store.prefix}-v4").stat().st_ino == inode
        [lent] = store.lend(4, 1)
        with open_share(decode_share(encode_share(lent))) as tensors:
            assert torch.equal(tensors["b"], state(4)["b"])
    finally:
        store.close()
    assert segments(store) == []


def test_dead_trainers_segments_are_swept() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)  # fmt: skip
    stale = shm_dir() / f"prime-async-{dead.stdout.strip()}-0badc0de-v3"
    mine = shm_dir() / f"prime-async-{os.getpid()}-0badc0de-v3"
    other = shm_dir() / "prime-async-not-a-segment"
    for path in (stale, mine, other):
        path.write_bytes(b"x")
    try:
        assert shared_memory.sweep_stale(shm_dir()) >= 1
        assert not stale.exists() and mine.exists() and other.exists()
    finally:
        for path in (stale, mine, other):
            path.unlink(missing_ok=True)


def test_mem_fraction_caps_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: calls.append((f, i)))
    assert not apply_mem_fraction(0.5, "cpu", who="trainer")
    assert not apply_mem_fraction(None, "cuda:0", who="trainer")
    assert apply_mem_fraction(0.4, torch.device("cuda", 2), who="engine")
    assert calls == [(0.4, 2)]


# ---- config: where the shared path cannot work, and each side's stated share --------------------------

SHARED = ["--weights.transport", "shared", "--trainer.runtime.mem-fraction", "0.5",
          "--inference.engine.mem-fraction", "0.4"]  # fmt: skip


def rl_error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(RLConfig, argv)
    message = str(info.value)
    assert "\n" not in message.strip(), "a refusal is one line"
    return message


def test_shared_needs_each_share_stated_and_their_sum_at_most_one() -> None:
    cfg = load_config(RLConfig, SHARED)
    assert cfg.trainer.weights.transport == cfg.orchestrator.weights.transport == "shared"
    assert (cfg.trainer.runtime.mem_fraction, cfg.inference.engine.mem_fraction) == (0.5, 0.4)
    error = rl_error(["--weights.transport", "shared"])
    assert "trainer.runtime.mem_fraction = None" in error and "inference.engine.mem_fraction = None" in error
    error = rl_error([*SHARED[:2], "--trainer.runtime.mem-fraction", "0.7", *SHARED[4:]])
    assert "trainer.runtime.mem_fraction = 0.7 with inference.engine.mem_fraction = 0.4" in error
    assert "1.1" in error


def test_use_shared_weights_states_the_default_shares_and_keeps_the_users() -> None:
    cfg = use_shared_weights(load_config(RLConfig, []))
    assert cfg.trainer.weights.transport == "shared"
    assert (cfg.trainer.runtime.mem_fraction, cfg.inference.engine.mem_fraction) == (0.5, 0.4)
    cfg = use_shared_weights(load_config(RLConfig, ["--trainer.runtime.mem-fraction", "0.3"]))
    assert (cfg.trainer.runtime.mem_fraction, cfg.inference.engine.mem_fraction) == (0.3, 0.4)
    with pytest.raises(ValueError, match="exceeds 1"):
        use_shared_weights(load_config(RLConfig, ["--trainer.runtime.mem-fraction", "0.9"]))


@pytest.mark.parametrize(
    ("argv", "keys"),
    [
        (["--inference.backend", "sglang"], ("weights.transport = 'shared'", "inference.backend = 'sglang'")),
        (["--lora.rank", "4", "--restart.max-restarts", "0"], ("lora", "weights.transport = 'shared'")),
        (["--transport.host", "10.0.0.2"], ("weights.transport = 'shared'", "transport.host")),
    ],
)  # fmt: skip
def test_shared_is_refused_where_it_cannot_work(argv: list[str], keys: tuple[str, str]) -> None:
    error = rl_error([*SHARED, *argv])
    for key in keys:
        assert key in error


def test_shared_with_remote_engines_eval_or_sft_is_refused(tmp_path) -> None:
    """A standalone orchestrator with an engine on another host; eval (versions from the broadcast
    directory); sft (no engines)."""
    remote = {"base_urls": ["http://127.0.0.1:30000", "http://10.0.0.2:30000"]}
    with pytest.raises(ValueError, match=r"'shared' with inference\.base_urls\[1\] = 'http://10\.0\.0\.2"):
        OrchestratorConfig(weights={"transport": "shared"}, inference=remote)
    eval_env = [{"id": "reverse-text", "name": "heldout"}]
    with pytest.raises(ValueError, match=r"eval\.envs with weights\.transport = 'shared'"):
        OrchestratorConfig(weights={"transport": "shared"}, eval={"envs": eval_env, "interval": 2})
    with pytest.raises(ValueError, match=r"weights\.transport = 'shared' with sft"):
        SFTConfig(data={"files": [str(tmp_path / "a.jsonl")]}, max_steps=2, weights={"transport": "shared"})
