"""`uv run rl @ rl.toml [--trainer @ t.toml] [--key value ...]`: one command for a whole run.

Parses `RLConfig` (shared fields propagated into the inference, orchestrator and trainer sections; see
`config/rl.py`), imports and validates every environment of the run (also under `--dry-run`; a typo in
an env id or arg exits 2 before any process starts), sets up logging, then imports and runs the launcher
`prime_async.launcher:run`, which starts and supervises the three component commands.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from prime_async.config.loader import parse_config
from prime_async.entrypoints.common import run_component, setup_logging

if TYPE_CHECKING:
    from prime_async.config.rl import RLConfig


def main(argv: Sequence[str] | None = None) -> None:
    # Imported here, not at module level: the sub-config schemas of three components load with it.
    from prime_async.config.rl import RLConfig

    cfg = parse_config(RLConfig, argv, prog="rl", check=check_run_envs)
    setup_logging(cfg.log, component="rl")
    from prime_async.launcher import run

    run_component(run, cfg, component="rl")


def check_run_envs(cfg: RLConfig) -> None:
    """Before anything starts (`--dry-run` too): every environment of the run is installed ("did you
    mean" otherwise), imports, and its args and config validate (`rollouts/env_check.py`)."""
    from prime_async.rollouts.verifiers_config import validate_envs

    validate_envs(cfg.orchestrator)


if __name__ == "__main__":
    main()
