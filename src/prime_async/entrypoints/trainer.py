"""`uv run trainer @ trainer.toml [--key value ...]`: the training loop (under torchrun for several ranks).

Parses `TrainerConfig` (config schemas never import torch, so `--help` and `--dry-run` return fast), sets up
logging, then imports and runs `prime_async.trainer.train:run`. The `rl` launcher starts it as
`python -m prime_async.entrypoints.trainer` under torchrun when `num_processes > 1`.
"""

from prime_async.entrypoints.commands import COMMANDS

main = COMMANDS["trainer"]  # the console script; entrypoints/commands.py

if __name__ == "__main__":
    main()
