"""Build the tiny random Qwen3-style model + tokenizer used by tests and the tiny config.

Usage: uv run python scripts/make_tiny_model.py OUT_DIR
"""

from __future__ import annotations

import argparse

from prime_async.models.tiny import build_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to write the HF model into")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = build_tiny_model(args.out_dir, seed=args.seed)
    print(f"tiny model written to {out}")


if __name__ == "__main__":
    main()
