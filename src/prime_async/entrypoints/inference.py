"""`uv run inference @ inference.toml [--key value ...]`: SGLang engine(s) or the embedded torch engine.

Parses `InferenceConfig` (config schemas never import torch, so `--help` and `--dry-run` return fast),
sets up logging, then imports and runs `prime_async.inference.server:run`.
"""

from prime_async.entrypoints.commands import COMMANDS

main = COMMANDS["inference"]  # the console script; entrypoints/commands.py

if __name__ == "__main__":
    main()
