"""`uv run rl @ rl.toml [--trainer @ t.toml] [--key value ...]`: one command for a whole run.

Parses `RLConfig` (shared fields propagated into the inference, orchestrator and trainer sections; see
`config/rl.py`), imports and validates every environment of the run (also under `--dry-run`; a typo in
an env id or arg exits 2 before any process starts), sets up logging, then imports and runs the launcher
`prime_async.launcher:run`, which starts and supervises the three component commands.
"""

from prime_async.entrypoints.commands import COMMANDS

main = COMMANDS["rl"]  # the console script; entrypoints/commands.py

if __name__ == "__main__":
    main()
