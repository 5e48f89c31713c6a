"""Control channel trainer <-> orchestrator over real ZeroMQ sockets on loopback.

- `Published` events reach the orchestrator and wake the weight watcher at once (event-driven: the
  fallback poll is 60 s here, the update happens within a second);
- the distributed handshake end to end: the trainer side (`DistributedPublisher`, joining a real gloo group as
  rank 0) and `DistributedLoader` driving a real embedded engine process; a version the trainer no
  longer holds is refused before the engine is asked to receive, and the group survives it;
- the shared-memory handshake (Lend, the engine's copy, GiveBack) with `SharedPublisher` and `SharedLoader`;
- malformed frames raise `WireError`; a transport mismatch fails the watcher with a clear message.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch

import zygote
from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.config.trainer import TrainerConfig
from prime_async.transport.wire import WireError
from prime_async.weights.control import ControlClient, Published, decode
from prime_async.weights.loaders import build_control
from prime_async.weights.loaders.filesystem import FilesystemLoader
from prime_async.weights.watcher import UpdateSignal
from proc_helpers import free_pair, free_port


def test_malformed_frame_is_a_wire_error():
    with pytest.raises(WireError, match="malformed"):
        decode(b"\x93garbage")
    with pytest.raises(WireError):
        decode(msgspec.msgpack.encode({"type": "published", "version": "x"}))


def test_published_event_reaches_the_orchestrator_and_fails_on_transport_mismatch():
    port = free_pair()
    cfg = OrchestratorConfig.model_validate({"transport": {"port": port}})

    async def go():
        signal = UpdateSignal()
        control, loader = build_control(cfg, signal)
        woken, errors = signal.event, []
        client = ControlClient("127.0.0.1", port + 1, handler=lambda msg, reply: None)
        try:
            await control.wait_trainer(30)
            t0 = time.monotonic()
            client.publish(Published(1, "filesystem"))
            await asyncio.wait_for(woken.wait(), 10)
            latency = time.monotonic() - t0
            client.publish(Published(2, "distributed"))
            for _ in range(200):
                if signal.failure is not None:
                    errors.append(signal.failure)
                    break
                await asyncio.sleep(0.05)
        finally:
            client.close()
            await control.close()
        return loader, latency, errors

    loader, latency, errors = asyncio.run(go())
    assert isinstance(loader, FilesystemLoader)  # every transport has a loader
    assert latency < 5.0
    assert errors and "weights.transport = 'filesystem'" in str(errors[0])


@pytest.fixture
def engine_url(tiny_model_dir: Path, tmp_path: Path):
    """A real embedded engine process on the tiny model (the other end of the weight process group)."""
    import httpx

    port = free_port()
    cfg = tmp_path / "inference.toml"
    cfg.write_text(
        f'backend = "torch"\nseq_len = 256\noutput_dir = "{tmp_path}"\n[model]\npath = "{tiny_model_dir}"\n'
        f'[server]\nport = {port}\n[engine]\nmax_running_requests = 2\ndevice = "cpu"\n'
    )
    log = (tmp_path / "engine.log").open("w")
    cmd = [sys.executable, "-m", "prime_async.entrypoints.inference", "@", str(cfg)]
    proc = zygote.popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "engine.log").read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield url, tmp_path / "engine.log"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.timeout(1200)  # the engine process starts in ~30 s, in minutes on a loaded machine
def test_distributed_handshake_trainer_to_engine(tiny_model_dir: Path, tmp_path: Path, engine_url):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from prime_async.inference.client import HttpEngineClient
    from prime_async.weights.publishers import Weights, build_publisher
    from prime_async.weights.writer import BroadcastWriter

    url, engine_log = engine_url
    port, master = free_pair(), free_port()
    weights = {"transport": "distributed", "bucket_mb": 0.01, "master_port": master}
    orch_cfg = OrchestratorConfig.model_validate({"transport": {"port": port}, "weights": weights})
    trainer_cfg = TrainerConfig.model_validate(
        {"transport": {"port": port}, "weights": weights, "output_dir": str(tmp_path)}
    )
    config = AutoConfig.from_pretrained(tiny_model_dir)
    writer = BroadcastWriter(output_dir=tmp_path, model_config=config, source_dir=tiny_model_dir, keep_last=2)
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    state = {k: v + 0.01 for k, v in base.items()}

    async def go():
        signal = UpdateSignal()
        control, loader = build_control(orch_cfg, signal)
        published = signal.event
        publisher = build_publisher(
            trainer_cfg, writer, torch.device("cpu"), tied=bool(config.tie_word_embeddings)
        )
        engine = HttpEngineClient(url)
        try:
            publisher.publish(Weights(state), 1, protected=(), on_disk=False)
            await asyncio.wait_for(published.wait(), 30)
            assert loader.latest() == 1
            await loader.load([engine], 1, flush_cache=True)
            assert await engine.weight_version() == 1
            state2 = {k: v + 1 for k, v in state.items()}
            for v in (2, 3, 4):  # the trainer keeps only its newest two snapshots
                published.clear()
                publisher.publish(Weights(state2 if v == 2 else state), v, protected=(), on_disk=False)
                await asyncio.wait_for(published.wait(), 30)
            loads = engine_log.read_text().count("tensors from group")
            with pytest.raises(RuntimeError, match="cannot send version 2"):
                await loader.load([engine], 2, flush_cache=True)
            assert engine_log.read_text().count("tensors from group") == loads  # engine never asked
            assert await engine.weight_version() == 1
            await loader.load([engine], 4, flush_cache=True)  # the group survives a refusal
            assert await engine.weight_version() == 4
        finally:
            publisher.close()
            await engine.aclose()
            await control.close()
        return loads

    loads = asyncio.run(go())
    assert loads > 3  # 0.01 MiB buckets: v1 arrived in several
    assert not (tmp_path / "broadcasts" / "step_1").exists()  # on_disk=False: memory only


@pytest.mark.timeout(1200)
def test_shared_handshake_trainer_to_engine(tiny_model_dir: Path, tmp_path: Path, engine_url):
    """`weights.transport = "shared"`: SharedPublisher keeps versions in shared memory, `SharedLoader` has
    them lent (Lend), copied by a real engine, and given back (GiveBack); a version the trainer no longer
    holds is `VersionGone` before the engine is asked anything."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from prime_async.inference.client import HttpEngineClient
    from prime_async.weights.loaders.base import VersionGone
    from prime_async.weights.publishers import Weights
    from prime_async.weights.publishers.shared import SharedPublisher
    from prime_async.weights.writer import BroadcastWriter

    url, engine_log = engine_url
    port = free_pair()
    orch_cfg = OrchestratorConfig.model_validate(
        {"transport": {"port": port}, "weights": {"transport": "shared"}}
    )
    trainer_cfg = TrainerConfig.model_validate(
        {"transport": {"port": port}, "weights": {"transport": "shared"}, "output_dir": str(tmp_path)}
    )
    config = AutoConfig.from_pretrained(tiny_model_dir)
    writer = BroadcastWriter(output_dir=tmp_path, model_config=config, source_dir=tiny_model_dir, keep_last=2)
    base = load_file(str(tiny_model_dir / "model.safetensors"))

    async def go():
        signal = UpdateSignal()
        control, loader = build_control(orch_cfg, signal)
        publisher = SharedPublisher(
            trainer_cfg, writer, torch.device("cpu"), tied=bool(config.tie_word_embeddings)
        )
        engine = HttpEngineClient(url)
        try:
            for v in (1, 2, 3, 4):  # the trainer keeps its newest two
                signal.event.clear()
                publisher.publish(
                    Weights({k: t + v for k, t in base.items()}), v, protected=(), on_disk=False
                )
                await asyncio.wait_for(signal.event.wait(), 30)
                if v == 1:
                    await loader.load([engine], 1, flush_cache=True)
                    assert await engine.weight_version() == 1
                    assert publisher.store.versions() == [1]  # given back: droppable like any other
            assert loader.latest() == 4 and publisher.store.versions() == [3, 4]
            with pytest.raises(VersionGone, match="cannot lend version 2"):
                await loader.load([engine], 2, flush_cache=True)
            assert engine_log.read_text().count("from shared memory") == 1  # engine never asked
            await loader.load([engine], 4, flush_cache=True)
            assert await engine.weight_version() == 4
        finally:
            publisher.close()
            await engine.aclose()
            await control.close()

    asyncio.run(go())
    assert engine_log.read_text().count("from shared memory") == 2
    assert not (tmp_path / "broadcasts" / "step_1").exists()  # on_disk=False: memory only
