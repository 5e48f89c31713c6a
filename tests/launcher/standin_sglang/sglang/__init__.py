"""Stand-in `sglang` package for lifecycle tests (see `launch_server.py`); never installed, only put on
PYTHONPATH by `tests/launcher/test_lifecycle.py`."""
