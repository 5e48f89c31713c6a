"""The megatron backend feeds its model on the model's device, whatever device it was built with.

On the first GPU machine every megatron test failed with "index is on cpu, different from other tensors
on cuda:0": the ids were built on the device the backend was given while megatron's DDP had put the
parameters on `torch.cuda.current_device()`. Here the model is moved to the meta device after the backend
is built (CPU ranks) and a spy on its forward checks the inputs of a real train step (`device_worker.py`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="needs the `megatron` extra")

WORKER = Path(__file__).with_name("device_worker.py")


def test_train_step_inputs_are_on_the_model_device(tiny_model_dir: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(tiny_model_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "inputs on meta: arg0, arg1, attention_mask" in proc.stdout
