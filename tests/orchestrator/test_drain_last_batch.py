"""The orchestrator's end-of-run drain waits only for a final batch its own lifetime sent."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from prime_async.orchestrator.main import _drain_last_batch
from prime_async.testing.synthetic import transport_cfg
from prime_async.transport.zmq_batches import BatchSender


def test_restarted_after_the_last_step_does_not_wait() -> None:
    """A lifetime that resumed past the final batch has nothing to serve: it must not wait the
    transport timeout (10 min by default) for a batch it never had."""
    sender = BatchSender(cfg=transport_cfg(), num_ranks=1)
    try:
        assert sender.last_step is None
        cfg = SimpleNamespace(max_steps=12, transport=SimpleNamespace(timeout_s=600.0))
        start = time.monotonic()
        asyncio.run(_drain_last_batch(sender, cfg))  # type: ignore[arg-type]
        assert time.monotonic() - start < 5.0
    finally:
        sender.close()
