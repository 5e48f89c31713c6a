"""The config-parsing commands as one table: name -> config class and run function, and one generic main.

    uv run inference | orchestrator | trainer | rl | eval | export-lora | export-megatron | sft

Every command does the same: parse its config from argv (`parse_config`: `@ file.toml` merging, `--help`,
`--dry-run`, one-line errors), set up logging, import its run function, and call it under the error policy
of `entrypoints/common.py`. The console scripts of pyproject.toml and `python -m
prime_async.entrypoints.<name>` both call `COMMANDS[name]`. `plan`, `doctor` and `new-env` parse flags of
their own and keep their own `main`.

Invariants: the config class and the run function are named as `module:attribute` strings (a test
resolves every one) and imported only
when the command runs, so `--help` and `--dry-run` never import torch or verifiers, and one command loads
only its own config schema; a rank process of torchrun (`trainer`, `sft`) never outlives its agent.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pkgutil import resolve_name
from typing import TYPE_CHECKING, Any

from prime_async.config.loader import parse_config
from prime_async.entrypoints.common import run_component, setup_logging

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from prime_async.config.base import BaseConfig
    from prime_async.config.rl import RLConfig
    from prime_async.config.sft import SFTConfig


@dataclass(frozen=True)
class Command:
    """One command: `config` and `run` name `module:attribute` below `prime_async` (see the module
    docstring).

    `check(cfg)` runs after validation, before `--dry-run` prints (what the schema cannot see);
    `lint` names a `config/lint.py` function: its warnings follow `--dry-run`'s TOML, and with `log_lint`
    are logged at start, never stopping (`rl` and the orchestrator; not each trainer rank);
    `prepare(cfg, argv)` runs after logging is set up, before `run` (it may re-exec the process);
    `rank_process`: under torchrun the process dies with its parent agent."""

    name: str
    config: str
    run: str
    check: Callable[[Any], None] | None = None
    lint: str | None = None
    log_lint: bool = False
    prepare: Callable[[Any, list[str]], None] | None = None
    rank_process: bool = False

    def __call__(self, argv: Sequence[str] | None = None) -> None:
        if self.rank_process and "TORCHELASTIC_RUN_ID" in os.environ:
            from prime_async.utils.process_tree import die_with_parent

            # a torchrun worker runs in a session of its own: if the agent is killed (SIGKILL, OOM),
            # nothing else would end this rank, and it would go on training beside the restarted one
            die_with_parent()
        args = list(sys.argv[1:] if argv is None else argv)
        lint = self.lint_lines if self.lint is not None else None
        cfg = parse_config(self.config_class(), args, prog=self.name, check=self.check, lint=lint)
        setup_logging(cfg.log, component=self.name)
        for line in lint(cfg) if lint is not None and self.log_lint else []:
            logger.warning(line)
        if self.prepare is not None:
            self.prepare(cfg, args)
        run_component(self.run_function(), cfg, component=self.name)

    def config_class(self) -> type[BaseConfig]:
        return resolve_name(f"prime_async.{self.config}")

    def lint_lines(self, cfg: Any) -> list[str]:
        """The lint's warnings about `cfg` (`config/lint.py`), one line each."""
        return [finding.line() for finding in resolve_name(f"prime_async.config.lint:{self.lint}")(cfg)]

    def run_function(self) -> Callable[[Any], Any]:
        return resolve_name(f"prime_async.{self.run}")


def check_run_envs(cfg: RLConfig) -> None:
    """`rl`, before anything starts (`--dry-run` too): every environment of the run is installed ("did you
    mean" otherwise), imports, and its args and config validate (`rollouts/verifiers_config.py`)."""
    from prime_async.rollouts.verifiers_config import validate_envs

    validate_envs(cfg.orchestrator)


def check_transport_keys(side: str) -> Callable[[Any], None]:
    """The check of a component on the batch stream and the control channel: with CURVE on (a non-loopback
    `transport.host`), its key files exist (`transport/curve.py`); otherwise one line, exit 2."""

    def check(cfg: Any) -> None:
        from prime_async.transport.curve import check_keys

        check_keys(cfg.transport, side=side)

    return check


def prepare_sft(cfg: SFTConfig, argv: list[str]) -> None:
    """`sft` outside torchrun: build the offline model `model.build` names when it is missing; with
    `num_processes` > 1, re-run this command under torchrun, one rank per process (as `rl` starts the
    trainer)."""
    if "RANK" in os.environ:
        return
    from prime_async.launcher.rl import ensure_model

    ensure_model(cfg)
    if cfg.num_processes > 1:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        ranks = f"--nproc-per-node={cfg.num_processes}"
        os.execv(sys.executable, [*torchrun, ranks, "-m", "prime_async.entrypoints.sft", *argv])


COMMANDS: dict[str, Command] = {
    c.name: c
    for c in (
        Command("inference", "config.inference:InferenceConfig", "inference.server:run"),
        Command(
            "orchestrator",
            "config.orchestrator:OrchestratorConfig",
            "orchestrator.main:run",
            check=check_transport_keys("server"),
            lint="lint_orchestrator",
            log_lint=True,
        ),
        Command(
            "trainer",
            "config.trainer:TrainerConfig",
            "trainer.train:run",
            rank_process=True,
            check=check_transport_keys("client"),
            lint="lint_trainer",
        ),
        Command(
            "rl", "config.rl:RLConfig", "launcher:run", check=check_run_envs, lint="lint_rl", log_lint=True
        ),
        Command("eval", "config.eval:EvalConfig", "launcher.eval_command:run"),
        Command("export-lora", "config.export:ExportLoraConfig", "trainer.export:run"),
        Command("export-megatron", "config.export:ExportMegatronConfig", "trainer.megatron.export:run"),
        Command("sft", "config.sft:SFTConfig", "sft.train:run", prepare=prepare_sft, rank_process=True),
    )
}
