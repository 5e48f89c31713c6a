"""Runs the trainer loop (`trainer/train.py::run`, megatron backend) for `test_megatron_loop.py` and
`test_megatron_checkpoint.py`: on CPU the backend itself switches to CPU ranks (gloo).

Usage: `python -m torch.distributed.run --standalone --nproc-per-node N loop_worker.py <trainer config json>`.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from prime_async.config.trainer import TrainerConfig
from prime_async.trainer.train import run

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run(TrainerConfig.model_validate(json.loads(Path(sys.argv[1]).read_text())))
