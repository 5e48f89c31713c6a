"""The `rl` launcher: runs inference, trainer and orchestrator together (see `launcher/rl.py`)."""

from prime_async.launcher.rl import run

__all__ = ["run"]
