"""Engine vs trainer logprobs at version 0: the trainer's model scores the probe episodes' sampled tokens.

The trainer model is loaded as the fsdp backend loads it (`trainer.model`, dtype included) and scores each
ok episode as one row (`packed_logprobs`, the trainer's own function) at the sampling temperature. The
figure is the trainer's `mismatch_kl`: the k3 estimator of KL(engine || trainer) per sampled token,
`rho - 1 - log rho` with `log rho = trainer - engine logprob`. MoE models are scored without routing replay
(the trainer's routing), which is what `router_replay` removes. A vision-language model's episode is scored
with its images as the trainer feeds them (`trainer/vision.py`: pixel values from the encoded images, M-RoPE
positions, image features on the images' spans only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prime_async.config.rl import RLConfig
from prime_async.rollouts.types import Episode
from prime_async.transport.types import MicroBatch

if TYPE_CHECKING:
    from prime_async.trainer.vision import RowVision


def mismatch_kl(cfg: RLConfig, episodes: list[Episode], temperature: float) -> tuple[float | None, int]:
    """(mean k3 KL per sampled token, number of tokens); (None, 0) without sampled tokens."""
    import torch

    from prime_async.trainer.fsdp import load_model

    rows = [e for e in episodes if e.status == "ok" and any(e.loss_mask)]
    if not rows:
        return None, 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the trainer's dtype on it
    from prime_async.trainer.vision import RowVision, is_vision_language

    model = load_model(cfg.trainer, device).eval()
    images = RowVision(model, cfg.model.path) if is_vision_language(cfg.model.path) else None
    return score_kl(model, rows, temperature, images)


def _row(ep: Episode) -> MicroBatch:
    """The episode as one unpacked trainer row with its images (what `RowVision` reads)."""
    import numpy as np

    from prime_async.rollouts.images import image_bytes
    from prime_async.transport.types import RowImage

    n = len(ep.token_ids)
    zeros = np.zeros(n, dtype=np.float32)
    images = [RowImage(im.offset, im.length, im.grid_thw, image_bytes(im.url)) for im in ep.images]
    return MicroBatch(
        input_ids=np.asarray(ep.token_ids, dtype=np.int32), position_ids=np.arange(n, dtype=np.int32),
        loss_mask=np.asarray(ep.loss_mask, dtype=np.bool_), advantages=zeros, sampler_logprobs=zeros,
        token_versions=np.full(n, -1, dtype=np.int32), images=images,
    )  # fmt: skip


def score_kl(
    model, rows: list[Episode], temperature: float, images: RowVision | None = None
) -> tuple[float | None, int]:
    """The k3 KL of `rows` (ok episodes) under `model`; every tensor is built on the model's device.
    `images`: a vision-language model's row inputs (episodes with images are scored with them)."""
    import contextlib

    import torch

    from prime_async.trainer.packed_rows import packed_logprobs
    from prime_async.utils.devices import model_device, on_model

    device = model_device(model)
    kl_sum, tokens = 0.0, 0
    with torch.no_grad():
        for ep in rows:
            ids = on_model(device, ep.token_ids, dtype=torch.long)
            mask = on_model(device, ep.loss_mask, dtype=torch.bool)
            mask[0] = False  # the first token has no predecessor to score it
            pos = torch.arange(len(ep.token_ids), device=device)
            row = _row(ep) if images is not None and ep.images else None
            extra = images.inputs(row, device) if images is not None and row is not None else None
            placing = images.placing(row, device) if extra is not None else contextlib.nullcontext()
            with placing:
                trainer_logp, _ = packed_logprobs(model, ids, pos, temperature, loss_mask=mask, vision=extra)
            engine_logp = on_model(device, ep.sampler_logprobs, dtype=torch.float64)[mask]
            log_rho = trainer_logp[mask].double() - engine_logp
            kl_sum += float((log_rho.exp() - 1 - log_rho).sum())
            tokens += int(mask.sum())
    return (kl_sum / tokens if tokens else None), tokens
