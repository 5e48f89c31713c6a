"""`uv run orchestrator @ orchestrator.toml [--key value ...]`: rollouts, train sink, weight updates.

Parses `OrchestratorConfig` (config schemas never import torch or verifiers, so `--help` and `--dry-run`
return fast), sets up logging, then imports and runs `prime_async.orchestrator.main:run`.
"""

from prime_async.entrypoints.commands import COMMANDS

main = COMMANDS["orchestrator"]  # the console script; entrypoints/commands.py

if __name__ == "__main__":
    main()
