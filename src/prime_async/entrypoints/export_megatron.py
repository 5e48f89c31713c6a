"""`uv run export-megatron --checkpoint DIR --output DIR`: a megatron-backend checkpoint as an HF model.

Parses `ExportMegatronConfig` (no torch import until it is valid), then runs
`prime_async.trainer.megatron.export:run`.
"""

from __future__ import annotations

from collections.abc import Sequence

from prime_async.config.export import ExportMegatronConfig
from prime_async.config.loader import parse_config
from prime_async.entrypoints.common import run_component, setup_logging


def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse_config(ExportMegatronConfig, argv, prog="export-megatron")
    setup_logging(cfg.log, component="export-megatron")
    from prime_async.trainer.megatron.export import run

    run_component(run, cfg, component="export-megatron")


if __name__ == "__main__":
    main()
