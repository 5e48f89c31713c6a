"""Weights: how a version travels from trainer rank 0 to every engine, one seam per side.

    trainer rank 0                                  orchestrator                      engines
    publishers/ (WeightPublisher, one file per  ──► loaders/ (WeightLoader, one  ──► /update_weights_*
    transport, `build_publisher`)                   file per transport,              (receiver.py,
         │ writer.py (broadcasts/step_N)             `build_control`)                 lora_client.py)
         └──── control.py (Published, requests) ────┘  watcher.py (WeightWatcher: when to load)

The transport is `weights.transport` (`prime_async.types.WeightTransport`, written once); LoRA adapters
travel over the filesystem transport (`publishers/lora.py`, `loaders/lora.py`). Adding a transport: one
publisher file, one loader file, one `WeightTransport` value. Modules are imported by path: this package
imports nothing, so the orchestrator's filesystem path never loads torch.
"""
