"""The fsdp backend on the tiny VLM (issue 40): packed rows with images (shared-prefix branches too) give
each sample the logprobs of its own unpacked HF forward, and the vision tower trains or stays frozen as
`optim.vision_tower` says."""

from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from prime_async.config.orchestrator import AdvantageConfig
from prime_async.orchestrator.batching import build_train_batch
from prime_async.orchestrator.types import Group
from prime_async.rollouts.types import Episode, EpisodeImage
from prime_async.trainer import vision
from prime_async.trainer.packed_rows import packed_logprobs, sample_starts

GRID = (1, 4, 4)  # a 56 x 56 image: 4 tokens


def _png(colour: tuple[int, int, int]) -> str:
    import base64

    buf = io.BytesIO()
    Image.new("RGB", (56, 56), colour).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _episode(tok, first: str, second: str, rng: random.Random) -> Episode:
    """[text, image 1, text, reply, text, image 2, text, reply]: the images at 3 and 14."""
    pad, vs, ve = (
        tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
    )
    words = lambda n: [rng.randrange(3, 900) for _ in range(n)]  # noqa: E731
    ids = [
        *words(2),
        vs,
        *[pad] * 4,
        ve,
        *words(2),
        *words(3),
        *words(1),
        vs,
        *[pad] * 4,
        ve,
        *words(1),
        *words(3),
    ]
    loss = [False] * 10 + [True] * 3 + [False] * 8 + [True] * 3
    images = [EpisodeImage(first, 3, 4, GRID, 0), EpisodeImage(second, 15, 4, GRID, 1)]
    return Episode(
        example_id=0, token_ids=ids, loss_mask=loss, sampler_logprobs=[-1.0 if m else 0.0 for m in loss],
        token_versions=[0 if m else -1 for m in loss], reward=rng.random(), images=images,
    )  # fmt: skip


@pytest.fixture(scope="module")
def model_and_tok(tiny_vlm_model_dir: Path):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(str(tiny_vlm_model_dir), dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(str(tiny_vlm_model_dir))


def _reference(model, proc, ep: Episode) -> torch.Tensor:
    """Logprobs of one unpacked episode: HF computes its own M-RoPE positions from the images."""
    from PIL import Image as PILImage

    from prime_async.rollouts.images import image_bytes

    pics = [PILImage.open(io.BytesIO(image_bytes(im.url))).convert("RGB") for im in ep.images]
    out = proc(images=pics, return_tensors="pt")
    ids = torch.tensor([ep.token_ids])
    fed = ids.clone()
    fed[0, -1] = 5  # the last token (a sampled image pad in one episode) feeds no logit
    with torch.no_grad():
        logits = model(
            input_ids=fed, pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
            mm_token_type_ids=(fed == model.config.image_token_id).int(),
        ).logits[0]  # fmt: skip
    logp = torch.log_softmax(logits[:-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
    return torch.cat([torch.zeros(1), logp])


@pytest.mark.parametrize("share", [False, True])
def test_packed_rows_with_images_match_unpacked_forwards(model_and_tok, tiny_vlm_model_dir, share) -> None:
    model, tok = model_and_tok
    rng = random.Random(0)
    red, blue, green = _png((200, 0, 0)), _png((0, 0, 200)), _png((0, 200, 0))
    episodes = [_episode(tok, red, blue, rng), _episode(tok, red, green, rng)]
    for ep in episodes[1:]:  # a group shares its prompt: the first 10 tokens (image 1 included)
        ep.token_ids[:10] = episodes[0].token_ids[:10]
    episodes[0].token_ids[-1] = tok.convert_tokens_to_ids("<|image_pad|>")  # the policy sampled one
    group = Group(group_id=0, example_id=0, dispatch_version=0, episodes=episodes)
    batch = build_train_batch([group], step=1, seq_len=256, num_ranks=1, temperature=1.0,
                              advantage_cfg=AdvantageConfig(), share_prefix=share)  # fmt: skip
    (mb,) = batch.micro_batches[0]
    assert len(mb.images) == (3 if share else 4)
    rv = vision.RowVision(model, str(tiny_vlm_model_dir))
    inputs = rv.inputs(mb, torch.device("cpu"))
    assert inputs is not None and inputs["position_ids"].shape == (4, 1, mb.num_tokens)
    ids, pos = (
        torch.from_numpy(mb.input_ids.astype(np.int64)),
        torch.from_numpy(mb.position_ids.astype(np.int64)),
    )
    mask = torch.from_numpy(mb.loss_mask)
    with torch.no_grad(), rv.placing(mb, torch.device("cpu")):
        logp, _ = packed_logprobs(model, ids, pos, 1.0, loss_mask=mask, vision=inputs)
    starts = np.flatnonzero(sample_starts(mb.position_ids)).tolist()
    for ep, start in zip(episodes, starts, strict=True):  # longest first: both are the same length here
        skip = int(mb.position_ids[start])
        want = _reference(model, rv.processor, ep)[skip:]
        got = logp[start : start + len(want)]
        m = torch.tensor(ep.loss_mask[skip:])
        assert torch.allclose(got[m], want[m], atol=1e-4), (got[m], want[m])


def test_vision_tower_frozen_or_trained(model_and_tok) -> None:
    model, _ = model_and_tok
    tower = vision.vision_tower(model)
    n = vision.freeze_vision_tower(model)
    assert n == sum(p.numel() for p in tower.parameters()) > 0
    assert not any(p.requires_grad for p in tower.parameters())
    assert any(p.requires_grad for p in model.lm_head.parameters())
    for p in tower.parameters():
        p.requires_grad_(True)


def test_megatron_refuses_a_vision_language_model(tiny_vlm_model_dir: Path) -> None:
    from prime_async.config.shared import ModelConfig
    from prime_async.config.trainer import TrainerConfig

    for model in (
        ModelConfig(path="models/none", build="tiny_vlm"),
        ModelConfig(path=str(tiny_vlm_model_dir)),
    ):
        with pytest.raises(ValueError, match="does not train vision-language models") as e:
            TrainerConfig(backend="megatron", model=model)
        assert "\n" not in str(e.value).split("does not train")[1].split("[type")[0].strip()


def test_lora_adapts_the_language_model_only(tiny_vlm_model_dir: Path) -> None:
    from transformers import AutoModelForImageTextToText

    from prime_async.config.shared import LoraConfig
    from prime_async.trainer.lora import adapter_tensors, apply_lora

    model = AutoModelForImageTextToText.from_pretrained(str(tiny_vlm_model_dir), dtype=torch.float32)
    apply_lora(model, LoraConfig(rank=4, alpha=8.0), str(tiny_vlm_model_dir))
    names = list(adapter_tensors(model))
    assert names and all(".language_model.layers." in n for n in names), names[:3]


def test_published_names_are_the_checkpoints(model_and_tok, tiny_vlm_model_dir: Path) -> None:
    """What the trainer publishes for a VLM carries the checkpoint's tensor names (`save_pretrained`'s, which
    SGLang's Qwen2.5-VL loader reads), and the embedded engine maps them back to its module names."""
    from safetensors import safe_open

    from prime_async.inference.vision import model_names

    model, _ = model_and_tok
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: not saved
    saved: set[str] = set()
    for file in tiny_vlm_model_dir.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            saved |= set(f.keys())
    published = vision.checkpoint_names(state)
    assert set(published) == saved and any(k.startswith("visual.") for k in published)
    assert set(model_names(published)) == set(state)
