"""`uv run rl @ rl.toml [--trainer @ t.toml] [--key value ...]`: one command for a whole run.

Parses `RLConfig` (shared fields propagated into the inference, orchestrator and trainer sections; see
`config/rl.py`), sets up logging, then imports and runs the launcher `prime_async.launcher:run`, which
starts and supervises the three component commands.
"""

from __future__ import annotations

from collections.abc import Sequence

from prime_async.config.loader import parse_config
from prime_async.entrypoints.common import run_component, setup_logging


def main(argv: Sequence[str] | None = None) -> None:
    # Imported here, not at module level: the sub-config schemas of three components load with it.
    from prime_async.config.rl import RLConfig

    cfg = parse_config(RLConfig, argv, prog="rl")
    setup_logging(cfg.log, component="rl")
    from prime_async.launcher import run

    run_component(run, cfg, component="rl")


if __name__ == "__main__":
    main()
