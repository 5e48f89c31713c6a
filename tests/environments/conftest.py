"""Fixtures of the environment tests: the HF-backed in-test engine module is importable as `hf_engine`."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)
