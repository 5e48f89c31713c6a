"""`uv run orchestrator @ orchestrator.toml [--key value ...]`: rollouts, train sink, weight updates.

Parses `OrchestratorConfig` (config schemas never import torch or verifiers, so `--help` and `--dry-run`
return fast), sets up logging, then imports and runs `prime_async.orchestrator.main:run`.
"""

from __future__ import annotations

from collections.abc import Sequence

from prime_async.config.loader import parse_config
from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.entrypoints.common import run_component, setup_logging


def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse_config(OrchestratorConfig, argv, prog="orchestrator")
    setup_logging(cfg.log, component="orchestrator")
    from prime_async.orchestrator.main import run

    run_component(run, cfg, component="orchestrator")


if __name__ == "__main__":
    main()
