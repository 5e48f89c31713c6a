"""Test doubles used by the test suite and the benchmark scripts, never by a running command.

`synthetic` builds wire batches and transport configs without a trainer (the simulator the tests and
`uv run plan` share is `prime_async.simulation`). Nothing under
`prime_async.testing` is imported by the runtime packages (a test checks this).
"""
