"""`uv run trainer @ trainer.toml [--key value ...]`: the training loop (under torchrun for several ranks).

Parses `TrainerConfig` (config schemas never import torch, so `--help` and `--dry-run` return fast), sets up
logging, then imports and runs `prime_async.trainer.train:run`. The `rl` launcher starts it as
`python -m prime_async.entrypoints.trainer` under torchrun when `num_processes > 1`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from prime_async.config.loader import parse_config
from prime_async.config.trainer import TrainerConfig
from prime_async.entrypoints.common import run_component, setup_logging
from prime_async.utils.process_tree import die_with_parent


def main(argv: Sequence[str] | None = None) -> None:
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # a torchrun worker runs in a session of its own: if the agent is killed (SIGKILL, OOM), nothing
        # else would end this rank, and it would go on training beside the restarted trainer
        die_with_parent()
    cfg = parse_config(TrainerConfig, argv, prog="trainer")
    setup_logging(cfg.log, component="trainer")
    from prime_async.trainer.train import run

    run_component(run, cfg, component="trainer")


if __name__ == "__main__":
    main()
