"""`uv run plan`: profile a run's generation, training and weight sync, then simulate candidate async
knobs (K, max_inflight_groups, max_buffered_groups, engines) with the scheduling simulator the tests use
(`simulation.py`) and recommend one. Never imported by a run."""
