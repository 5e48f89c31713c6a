"""Write weight versions to the filesystem: `output_dir/broadcasts/step_{n}/` (HF safetensors dir).

`BroadcastWriter` is the disk writer every trainer-side publisher (`weights/publishers/`) uses: on rank 0,
with the full (unsharded) state dict or a LoRA adapter.

Invariants:
- a version directory is written under `broadcasts/.tmp_step_{n}`, `STABLE` is written last inside it, then
  it is renamed to `step_{n}`: a reader that sees `step_{n}/STABLE` sees complete files;
- it holds `model.safetensors` (tied weights stored once, as `save_pretrained` does), `config.json`,
  `generation_config.json` and the tokenizer files (a VLM's processor files too) of the source model:
  loadable by transformers' `from_pretrained` and SGLang's `/update_weights_from_disk`;
- with LoRA (`publish_adapter`) a version directory is a PEFT adapter directory instead:
  `adapter_config.json` + `adapter_model.safetensors` (+ `STABLE`), written by the same tmp-rename rule;
- retention: the `keep_last` (>= 2) newest versions are never deleted, so the version the orchestrator is
  loading (the newest) and the one before it (possibly still being loaded by a slow engine) survive;
  versions of checkpoint steps are kept too; everything older is deleted.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from prime_async.models.moe_layout import split_experts
from prime_async.weights.broadcasts import (
    ADAPTER_WEIGHTS,
    STABLE,
    install_version,
    remove_version,
    versions,
)

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "added_tokens.json",
    "generation_config.json",
    # a vision-language model's processor: a restarted engine serving a broadcast loads it from there
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
)


def _fsync_dir_files(path: Path) -> None:
    for f in path.iterdir():
        with f.open("rb") as fh:
            os.fsync(fh.fileno())


class BroadcastWriter:
    """Writes weight versions atomically and prunes old ones by the retention rule above."""

    def __init__(self, *, output_dir: Path, model_config, source_dir: str | Path, keep_last: int):
        assert keep_last >= 2, "keep_last < 2 could delete a version the orchestrator is still loading"
        self.root = Path(output_dir) / "broadcasts"
        self.model_config = model_config
        self.source_dir = Path(source_dir)
        self.keep_last = keep_last
        self.root.mkdir(parents=True, exist_ok=True)

    def publish(
        self,
        state_dict: dict[str, torch.Tensor],
        version: int,
        *,
        protected: Iterable[int] = (),
        durable: bool = True,
    ) -> Path:
        """Write version `version` from a full state dict (rank 0 only), then prune. `durable`: fsync the
        files before STABLE (for versions a restart after a crash may load)."""
        final = self.root / f"step_{version}"
        tmp = self.root / f".tmp_step_{version}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
        if getattr(self.model_config, "tie_word_embeddings", False):
            tensors.pop("lm_head.weight", None)
        tensors = split_experts(tensors)  # MoE: one tensor per expert, as HF checkpoints and SGLang name them
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        self.model_config.save_pretrained(tmp)
        for name in TOKENIZER_FILES:
            if (self.source_dir / name).is_file():
                shutil.copy2(self.source_dir / name, tmp / name)
        if durable:
            _fsync_dir_files(tmp)
        (tmp / STABLE).write_text(f"{version}\n")
        install_version(self.root, version, tmp)  # atomic also when re-publishing an existing version
        self.prune(protected)
        return final

    def publish_adapter(
        self, config, tensors: dict[str, torch.Tensor], version: int, *, protected: Iterable[int] = ()
    ) -> Path:
        """Write version `version` as a PEFT adapter directory (rank 0 only), then prune."""
        tmp = self.root / f".tmp_step_{version}"
        shutil.rmtree(tmp, ignore_errors=True)
        write_adapter(tmp, config, tensors)
        _fsync_dir_files(tmp)
        (tmp / STABLE).write_text(f"{version}\n")
        final = install_version(self.root, version, tmp)
        self.prune(protected)
        return final

    def prune(self, protected: Iterable[int] = ()) -> list[int]:
        """Keep the `keep_last` newest versions and `protected` ones. Newest by number is newest in the
        run's history, because a rollback discards the versions after it (`broadcasts.discard_after`)."""
        published = versions(self.root)
        keep = set(published[-self.keep_last :]) | set(protected)
        removed = [v for v in published if v not in keep]
        for v in removed:
            remove_version(self.root, v)
        return removed


def write_adapter(directory: Path, config, tensors: dict[str, torch.Tensor]) -> None:
    """Write `adapter_config.json` + `adapter_model.safetensors` (PEFT's layout) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(directory))
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
