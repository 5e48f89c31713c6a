"""Chats -> token ids and a loss mask, with the renderer the RL rollouts of the same model use.

The renderer is chosen as the rollouts choose it (`rollouts/renderer_choice.py`), so SFT trains the exact
token layout that `rl` later samples in.

Invariants (per rendered chat):
- `token_ids` is the full render (`add_generation_prompt = False`) of the chat;
- a token is trained iff it belongs to a message whose role is in `train_on`, it lies after the
  generation prompt that precedes that message (the role header, e.g. `<|im_start|>assistant\\n`, is
  context: the engine prepends it, the model never samples it), up to and including the message's first
  stop token (what follows, e.g. the template's newline after `<|im_end|>`, is never sampled either),
  and the renderer's `sampled_mask` marks it as sampled when the renderer gives one (hand-written
  renderers do; the Jinja `default` one does not). What the renderer's template puts into the last
  assistant turn (e.g. Qwen3's empty `<think>` block) is trained: the model samples it in `rl` too;
- the first token is never trained (it is predicted by nothing);
- when the render of the chat up to a trained message plus its generation prompt is not a prefix of the
  full render (a template that rewrites history), that message's tokens attributed to it are trained
  whole and a warning is logged once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from prime_async.sft.data import Chat

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rendered:
    token_ids: list[int]
    loss_mask: list[bool]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class ChatRenderer:
    """Renders chats for one model directory."""

    def __init__(self, model_path: str, train_on: list[str]):
        from pydantic import TypeAdapter
        from renderers import RendererConfig, create_renderer
        from renderers.base import load_tokenizer

        from prime_async.rollouts.renderer_choice import choose_renderer

        choice = choose_renderer({"name": "auto"}, model_path)
        self.name = choice["name"]
        self.tokenizer = load_tokenizer(model_path)
        config = TypeAdapter(RendererConfig).validate_python(choice)
        self._renderer: Any = create_renderer(self.tokenizer, config)
        self._stops = set(self._renderer.get_stop_token_ids())
        self.train_on = set(train_on)
        self._warned = False

    def render(self, chat: Chat) -> Rendered:
        out = self._renderer.render(chat.messages, tools=chat.tools)
        ids = list(out.token_ids)
        mask = [False] * len(ids)
        sampled = list(out.sampled_mask) or [True] * len(ids)  # empty: the renderer cannot tell
        for i, message in enumerate(chat.messages):
            if message.get("role") in self.train_on:
                for pos in self._trained_positions(chat, i, ids, out.message_indices):
                    mask[pos] = sampled[pos]
        if mask:
            mask[0] = False
        return Rendered(token_ids=ids, loss_mask=mask)

    def _trained_positions(self, chat: Chat, i: int, ids: list[int], owners: list[int]) -> list[int]:
        prefix = self._renderer.render_ids(chat.messages[:i], tools=chat.tools, add_generation_prompt=True)
        start = len(prefix)
        if ids[:start] != prefix:
            if not self._warned:
                logger.warning("renderer %s: history changes when a turn is appended; role headers of "
                               "trained turns are trained too", self.name)  # fmt: skip
                self._warned = True
            start = 0
        positions = []
        for pos in range(start, len(ids)):
            if owners[pos] != i:
                continue
            positions.append(pos)
            if ids[pos] in self._stops:
                break
        return positions
