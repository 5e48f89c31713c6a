"""`uv run trainer @ trainer.toml [--key value ...]`: the training loop (under torchrun for several ranks).

Parses `TrainerConfig` (config schemas never import torch, so `--help` and `--dry-run` return fast), sets up
logging, then imports and runs `prime_async.trainer.train:run`. The `rl` launcher starts it as
`python -m prime_async.entrypoints.trainer` under torchrun when `num_processes > 1`.
"""

from __future__ import annotations

from collections.abc import Sequence

from prime_async.config.loader import parse_config
from prime_async.config.trainer import TrainerConfig
from prime_async.entrypoints.common import run_component, setup_logging


def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse_config(TrainerConfig, argv, prog="trainer")
    setup_logging(cfg.log, component="trainer")
    from prime_async.trainer.train import run

    run_component(run, cfg, component="trainer")


if __name__ == "__main__":
    main()
