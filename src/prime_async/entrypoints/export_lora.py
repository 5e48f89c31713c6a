"""`uv run export-lora --adapter DIR --output DIR`: merge a LoRA adapter into a full HF model directory.

Parses `ExportLoraConfig` (no torch import until it is valid), then runs `prime_async.trainer.export:run`.
"""

from prime_async.entrypoints.commands import COMMANDS

main = COMMANDS["export-lora"]  # the console script; entrypoints/commands.py

if __name__ == "__main__":
    main()
