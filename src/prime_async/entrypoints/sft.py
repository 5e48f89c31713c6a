"""`uv run sft @ sft.toml [--key value ...]`: supervised fine-tuning (under torchrun for several ranks).

Parses `SFTConfig`, builds the offline model `model.build` names when it is missing, then runs
`prime_async.sft.train:run`; with `num_processes` > 1 it re-runs itself under torchrun first.
"""

from prime_async.entrypoints.commands import COMMANDS

main = COMMANDS["sft"]  # the console script; entrypoints/commands.py

if __name__ == "__main__":
    main()
