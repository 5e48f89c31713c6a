"""Incomplete or failed weight writes: nothing half-written is ever loaded, the old weights stay.

- a write that fails mid-file (a full disk: ENOSPC raised by the tensor writer after half the bytes) raises
  out of `BroadcastWriter.publish`, leaves no `step_N`, and every reader (the orchestrator's
  `BroadcastDir`, the launcher's restart lookup) still answers the previous version;
- a directory without `STABLE` is never used by either reader;
- a `STABLE` directory whose tensor file is truncated (what a crash of a non-atomic writer leaves) is refused
  by the real engine process with HTTP 400 and one clear message; it keeps serving the old weights.
The full-disk case is simulated (no way to fill a disk here); everything else is real files and processes.
"""

from __future__ import annotations

import errno
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoConfig

import zygote
from prime_async.launcher.restart import latest_stable_broadcast
from prime_async.weights import writer as weights_mod
from prime_async.weights.broadcasts import BroadcastDir
from prime_async.weights.writer import BroadcastWriter
from proc_helpers import free_port, wait_healthy

GREEDY = {"temperature": 0.0, "max_new_tokens": 6}


def _state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(next(model_dir.glob("*.safetensors"))))


def test_full_disk_during_publish_leaves_the_previous_version(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch
):
    torch.set_num_threads(1)
    publisher = BroadcastWriter(
        output_dir=tmp_path, model_config=AutoConfig.from_pretrained(tiny_model_dir),
        source_dir=tiny_model_dir, keep_last=2,
    )  # fmt: skip
    state = _state_dict(tiny_model_dir)
    publisher.publish(state, 1)
    real_save = weights_mod.save_file

    def disk_full(tensors, path, metadata=None):
        real_save(tensors, path, metadata=metadata)
        with open(path, "r+b") as f:  # half the bytes made it to disk, then the disk was full
            f.truncate(Path(path).stat().st_size // 2)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(weights_mod, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        publisher.publish(state, 2)
    assert not (tmp_path / "broadcasts" / "step_2").exists()
    assert BroadcastDir(tmp_path / "broadcasts").latest_stable() == 1
    assert latest_stable_broadcast(tmp_path) == 1
    # a complete-looking directory without STABLE (writer died before the marker) is ignored as well
    shutil.copytree(tmp_path / "broadcasts" / "step_1", tmp_path / "broadcasts" / "step_3")
    (tmp_path / "broadcasts" / "step_3" / "STABLE").unlink()
    assert BroadcastDir(tmp_path / "broadcasts").latest_stable() == 1
    assert latest_stable_broadcast(tmp_path) == 1


@pytest.mark.timeout(240)
def test_engine_refuses_truncated_weights_and_keeps_serving(tiny_model_dir: Path, tmp_path: Path):
    port = free_port()
    cfg = tmp_path / "inference.toml"
    cfg.write_text(
        f'backend = "torch"\nseq_len = 256\n[model]\npath = "{tiny_model_dir}"\n[server]\nport = {port}\n'
    )
    log = tmp_path / "inference.log"
    with log.open("w") as fh:
        argv = [sys.executable, "-m", "prime_async.entrypoints.inference", "@", str(cfg)]
        proc = zygote.popen(argv, stdout=fh, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        assert _listening_hosts(port) == {"127.0.0.1"}  # the engine's HTTP server binds loopback by default
        probe = {"input_ids": [81, 82, 83], "sampling_params": GREEDY, "return_logprob": True}
        before = httpx.post(f"{url}/generate", json=probe, timeout=60).json()
        bad = tmp_path / "broadcasts" / "step_1"
        shutil.copytree(tiny_model_dir, bad)
        tensors = next(bad.glob("*.safetensors"))
        with tensors.open("r+b") as f:
            f.truncate(tensors.stat().st_size // 2)
        (bad / "STABLE").write_text("1\n")
        body = {"model_path": str(bad), "weight_version": "1"}
        r = httpx.post(f"{url}/update_weights_from_disk", json=body, timeout=60)
        assert r.status_code == 400, r.text
        message = r.json()["message"]
        assert "unreadable weights file" in message and "\n" not in message
        assert "refused weights" in log.read_text()  # reported in the engine's log too
        after = httpx.post(f"{url}/generate", json=probe, timeout=60).json()
        assert after["output_ids"] == before["output_ids"]
        assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _listening_hosts(port: int) -> set[str]:
    """IPv4 addresses LISTENing on `port`, from /proc/net/tcp."""
    hosts = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:
            hosts.add(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return hosts
