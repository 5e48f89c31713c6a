"""`uv run export-lora --adapter DIR --output DIR`: merge a LoRA adapter into a full HF model directory.

Parses `ExportLoraConfig` (no torch import until it is valid), then runs `prime_async.trainer.export:run`.
"""

from __future__ import annotations

from collections.abc import Sequence

from prime_async.config.export import ExportLoraConfig
from prime_async.config.loader import parse_config
from prime_async.entrypoints.common import run_component, setup_logging


def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse_config(ExportLoraConfig, argv, prog="export-lora")
    setup_logging(cfg.log, component="export-lora")
    from prime_async.trainer.export import run

    run_component(run, cfg, component="export-lora")


if __name__ == "__main__":
    main()
