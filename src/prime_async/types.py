"""Literals shared across packages, defined once (imported by config/, inference/, orchestrator/; no torch).

PauseMode        how the orchestrator pauses inference for a weight update (config `pause_mode`):
                 retract (requeue running requests, keep their tokens), in_place (keep the KV cache,
                 flush once idle), drain (stop admitting and let in-flight work finish);
EnginePauseMode  the `mode` of SGLang's `/pause_generation` (abort, retract, in_place); `drain` is
                 an orchestrator-side mode and never reaches an engine;
WeightTransport  how a weight version travels trainer -> engines (config `weights.transport`, the
                 control channel's `Published.transport`): filesystem, distributed, shared.
"""

from __future__ import annotations

from typing import Literal

PauseMode = Literal["retract", "in_place", "drain"]
EnginePauseMode = Literal["abort", "retract", "in_place"]
WeightTransport = Literal["filesystem", "distributed", "shared"]
