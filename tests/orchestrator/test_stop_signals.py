"""SIGTERM/SIGINT of the orchestrator (`planned_stop.stop_on_signals`): the first sets the stop event, a
repeated one is ignored, and after the loop's handlers are removed the signals stay ignored until the
process exits, so a signal during the teardown never turns a planned stop (exit 143) into a kill by
signal (-15), which `rl` answers with a rollback (audit 2026-12-04, R1)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import asyncio, os, signal, sys, time
    from prime_async.orchestrator.planned_stop import stop_on_signals

    async def main():
        with stop_on_signals() as stop:
            assert not stop.is_set()
            os.kill(os.getpid(), signal.SIGTERM)  # the planned stop
            await asyncio.wait_for(stop.wait(), 5)
            os.kill(os.getpid(), signal.SIGINT)  # repeated (Ctrl-C as well): ignored
            await asyncio.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)  # teardown after the loop's handlers: still ignored
        time.sleep(0.2)

    asyncio.run(main())
    sys.exit(143)
    """
)


def test_repeated_and_late_signals_do_not_kill_a_stopping_orchestrator() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 143, (proc.returncode, proc.stderr[-2000:])
    assert "stops as planned" in proc.stderr and "already stopping (ignored)" in proc.stderr, proc.stderr
    assert "is exiting (ignored)" in proc.stderr, proc.stderr
