"""Evaluation: held-out environments run at one weights version (`episodes.py`), during a training run
(`in_run.py`, placements shared / dedicated / external) or by the `eval` command (`command.py`)."""
