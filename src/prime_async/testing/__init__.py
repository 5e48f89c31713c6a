"""Test doubles used by the test suite and the benchmark scripts, never by a running command.

`simulation` wires the real orchestrator components around simulated engines on a virtual clock;
`synthetic` builds wire batches and transport configs without a trainer. Nothing under
`prime_async.testing` is imported by the runtime packages (a test checks this).
"""
