"""LoRA (`lora` set; `weights.transport = "filesystem"`, `config/interactions.py` refuses the others):
only the adapter travels, as a PEFT adapter directory `broadcasts/step_N/` (+ STABLE), then announced;
the engines load it as adapter `vN` (`weights/loaders/lora.py`).

Invariants: the adapter directory is complete (fsynced, STABLE last, renamed into place) before the
announcement; it is written on the training thread (an adapter is small), so `flush()` has nothing to do.
"""

from __future__ import annotations

from collections.abc import Iterable

from prime_async.weights.publishers.base import ControlledPublisher, Weights


class LoraAdapterPublisher(ControlledPublisher):
    """LoRA adapters through the broadcast directory."""

    transport = "filesystem"

    def publish(self, weights: Weights, version: int, *, protected: Iterable[int], on_disk: bool) -> None:
        if weights.adapter_config is None:
            raise ValueError("a LoRA run publishes adapters: the trainer handed over full weights")
        self.writer.publish_adapter(weights.adapter_config, weights.tensors, version, protected=protected)
        self.announce(version)
