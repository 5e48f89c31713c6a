"""`uv run export-megatron --checkpoint DIR --output DIR`: a megatron-backend checkpoint as an HF model.

Parses `ExportMegatronConfig` (no torch import until it is valid), then runs
`prime_async.trainer.megatron.export:run`.
"""

from prime_async.entrypoints.commands import COMMANDS

main = COMMANDS["export-megatron"]  # the console script; entrypoints/commands.py

if __name__ == "__main__":
    main()
