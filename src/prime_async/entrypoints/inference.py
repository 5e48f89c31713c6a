"""`uv run inference @ inference.toml [--key value ...]`: SGLang engine(s) or the embedded torch engine.

Parses `InferenceConfig` (config schemas never import torch, so `--help` and `--dry-run` return fast),
sets up logging, then imports and runs `prime_async.inference.server:run`.
"""

from __future__ import annotations

from collections.abc import Sequence

from prime_async.config.inference import InferenceConfig
from prime_async.config.loader import parse_config
from prime_async.entrypoints.common import run_component, setup_logging


def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse_config(InferenceConfig, argv, prog="inference")
    setup_logging(cfg.log, component="inference")
    from prime_async.inference.server import run

    run_component(run, cfg, component="inference")


if __name__ == "__main__":
    main()
