"""Runs the trainer loop (`trainer/train.py::run`, megatron backend) under the CPU shim, for
`test_megatron_loop.py`.

Usage: `python -m torch.distributed.run --standalone --nproc-per-node N loop_worker.py <trainer config json>`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from cpu_shim import apply_cpu_shim

apply_cpu_shim()

from prime_async.config.trainer import TrainerConfig  # noqa: E402
from prime_async.trainer.train import run  # noqa: E402

if __name__ == "__main__":
    run(TrainerConfig.model_validate(json.loads(Path(sys.argv[1]).read_text())))
