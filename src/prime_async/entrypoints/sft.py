"""`uv run sft @ sft.toml [--key value ...]`: supervised fine-tuning (under torchrun for several ranks).

Parses `SFTConfig`, builds the offline model `model.build` names when it is missing, then runs
`prime_async.sft.train:run`; with `num_processes` > 1 it re-runs itself under torchrun first.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from prime_async.config.loader import parse_config
from prime_async.config.sft import SFTConfig
from prime_async.entrypoints.common import run_component, setup_logging
from prime_async.utils.process_tree import die_with_parent


def main(argv: Sequence[str] | None = None) -> None:
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()  # as `trainer`: a rank never outlives its torchrun agent
    cfg = parse_config(SFTConfig, argv, prog="sft")
    setup_logging(cfg.log, component="sft")
    from prime_async.launcher.rl import ensure_model
    from prime_async.sft.train import run

    if "RANK" not in os.environ:
        ensure_model(cfg)
        if cfg.num_processes > 1:  # one rank per process, as `rl` starts the trainer
            args = list(argv) if argv is not None else sys.argv[1:]
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            ranks = f"--nproc-per-node={cfg.num_processes}"
            os.execv(sys.executable, [*torchrun, ranks, "-m", "prime_async.entrypoints.sft", *args])
    run_component(run, cfg, component="sft")


if __name__ == "__main__":
    main()
