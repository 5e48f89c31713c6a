"""Stand-in for `python -m sglang.launch_server`, for lifecycle tests on machines without SGLang.

It serves real generation (the project's embedded engine behind SGLang's HTTP routes) and starts helper
processes the way SGLang's server does: two multiprocessing children in the server's process group (like
its scheduler and detokenizer), which die with the server (SGLang's children watch their parent) and one
of which ignores SIGTERM (so only a SIGKILL, or the server's death, ends it). It reports no run id, as
SGLang does not. Flags it does not need are accepted and ignored, as the launcher passes SGLang's.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import os
import signal
import time

_PR_SET_PDEATHSIG = 1


def _helper(ignore_sigterm: bool) -> None:
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(1.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--context-length", type=int, default=2048)
    parser.add_argument("--weight-version", default="0")
    parser.add_argument("--api-key", default=None)
    args, _unused = parser.parse_known_args()
    context = multiprocessing.get_context("fork")
    for name, stubborn in (("scheduler", True), ("detokenizer", False)):
        context.Process(target=_helper, args=(stubborn,), name=name, daemon=False).start()

    from prime_async.config.inference import InferenceConfig
    from prime_async.inference.server import run

    cfg = InferenceConfig.model_validate(
        {
            "backend": "torch",
            "model": {"path": args.model_path},
            "server": {"host": args.host, "port": args.port, "api_key": args.api_key},
            "seq_len": args.context_length,
            "weight_version": int(float(args.weight_version)),
        }
    )
    print(f"stand-in sglang server pid {os.getpid()} on port {args.port}", flush=True)
    run(cfg)


if __name__ == "__main__":
    main()
