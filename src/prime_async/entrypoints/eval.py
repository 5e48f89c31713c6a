"""`uv run eval @ eval.toml [--key value ...]`: evaluate a model or a run's published weights.

Parses `EvalConfig` (config schemas never import torch or verifiers, so `--help` and `--dry-run` return
fast), sets up logging, then imports and runs `prime_async.launcher.eval_command:run`.
"""

from __future__ import annotations

from collections.abc import Sequence

from prime_async.config.eval import EvalConfig
from prime_async.config.loader import parse_config
from prime_async.entrypoints.common import run_component, setup_logging


def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse_config(EvalConfig, argv, prog="eval")
    setup_logging(cfg.log, component="eval")
    from prime_async.launcher.eval_command import run

    run_component(run, cfg, component="eval")


if __name__ == "__main__":
    main()
