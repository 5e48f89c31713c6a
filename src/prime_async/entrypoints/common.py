"""What every command does around its component: logging setup and the top-level error policy.

Called by the commands of `entrypoints/commands.py` (and `doctor`) after the config is parsed.

Invariants: handlers are configured here only (components just `logging.getLogger(__name__)`); a
`ValueError` escaping a component is a user/config error: it is logged as one line (its traceback only at
DEBUG) and the command exits 2; Ctrl-C exits 130 without a traceback; any other exception propagates
with its traceback.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prime_async.config.shared import LogConfig

logger = logging.getLogger(__name__)

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
PLAIN_FORMAT = "%(asctime)s %(levelname)s [{component}] %(name)s: %(message)s"


def _component_label(component: str) -> str:
    """`trainer` or, under torchrun with several ranks, `trainer:rank1`."""
    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return f"{component}:rank{os.environ.get('RANK', '0')}" if world_size > 1 else component


def setup_logging(log_cfg: LogConfig, *, component: str) -> None:
    """Configure the root logger: rich on an interactive terminal, plain timestamped lines otherwise."""
    level = log_cfg.level
    label = _component_label(component)
    if sys.stderr.isatty():
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(show_path=False, rich_tracebacks=False)
        handler.setFormatter(logging.Formatter(f"[{label}] %(name)s: %(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(PLAIN_FORMAT.format(component=label)))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    # Third-party chatter stays at WARNING unless the user asks for DEBUG.
    for noisy in ("httpx", "httpcore", "urllib3", "filelock", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if level == "DEBUG" else logging.WARNING)


def run_component(run: Callable[[Any], Any], cfg: Any, *, component: str) -> None:
    """Call `run(cfg)` under the error policy of the module docstring."""
    try:
        run(cfg)
    except KeyboardInterrupt:
        logger.warning("%s interrupted", component)
        raise SystemExit(EXIT_INTERRUPTED) from None
    except ValueError as exc:
        logger.debug("traceback of the error below", exc_info=True)
        logger.error("%s: error: %s (traceback with --log.level DEBUG)", component, exc)
        raise SystemExit(EXIT_USAGE) from None
