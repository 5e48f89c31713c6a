"""`uv run eval @ eval.toml [--key value ...]`: evaluate a model or a run's published weights.

Parses `EvalConfig` (config schemas never import torch or verifiers, so `--help` and `--dry-run` return
fast), sets up logging, then imports and runs `prime_async.launcher.eval_command:run`.
"""

from prime_async.entrypoints.commands import COMMANDS

main = COMMANDS["eval"]  # the console script; entrypoints/commands.py

if __name__ == "__main__":
    main()
