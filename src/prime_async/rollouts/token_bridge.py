"""Token-exact multi-turn prompts (token in, token out) for every chat template: the renderer the rollout
source hands verifiers' train client, wrapping the renderer the model gets (`renderer_choice.py`).

verifiers' train client renders each turn's prompt. When the new prompt's messages extend the previous
turn's (its trace graph finds the previous sampled assistant as the prefix and the new messages are
tool results and/or one user message), it asks the renderer to *bridge*: the next prompt is then
`previous prompt ids + previous completion ids (as sampled) + the tokens of the new messages`. A
renderer that cannot bridge returns None and the whole chat is rendered again from its text, so a reply
sampled as a non-canonical token sequence comes back re-tokenized and verifiers splits the episode into
branches (only the last one is trained). `DefaultRenderer` (any model without a hand-written renderer:
the tiny model, SmolLM2) never bridges, and typed renderers decline where their chat template would
re-render earlier turns differently (Qwen3 drops earlier turns' thinking at a new user message).

`TokenExactRenderer` bridges every such turn. Its rule (`suffix_text`):

- the inner renderer's own bridge is used when it gives one (hand-written, exact);
- otherwise the template renders `[user "u", assistant MARK, *new_messages]` with the generation
  prompt, and the suffix is the text after MARK: the template's close of the assistant turn, each new
  message with its turn separators, and the generation prompt. The sampled completion stands in for
  MARK: when it ended with a stop token whose text opens the suffix (ChatML's `<|im_end|>`), that text
  is not repeated; a completion cut by `max_tokens` gets the template's close appended;
- the suffix text is tokenized alone (special tokens parsed, no BOS) and appended to the sampled ids.

Invariants of a bridge it returns: `token_ids[:len(prev_prompt) + len(prev_completion)]` equals
`prev_prompt + prev_completion` exactly (a sampled reply is never re-tokenized); tokens past that carry
the index of the new message they render (-1 for separators and the generation prompt); the sampled
part of the returned context is what the engine sampled, not what the template would re-render (earlier
thinking kept, whitespace as sampled). It declines (None: verifiers renders afresh, the episode may
split, `episode.py` counts it as `template_rerender`) when the template fails on the probe chat, the
probe renders are not prefix-stable after MARK, or multimodal data is involved.

Configured as a `renderers` custom renderer (`custom_config`), so it is built by import path in
whichever process runs verifiers' train client (the orchestrator, or verifiers' env server).
"""

from __future__ import annotations

import itertools
from typing import Any

from pydantic import ConfigDict
from renderers.base import RenderedTokens
from renderers.configs import BaseRendererConfig

IMPORT_PATH = "prime_async.rollouts.token_bridge.TokenExactRenderer"
MARK = "\u2063prime-async-sampled-reply\u2063"  # stands in for the sampled completion in probe renders
_PROBE_USER = {"role": "user", "content": "u"}


class TokenExactRendererConfig(BaseRendererConfig):
    """`inner`: the wrapped renderer's `renderers.RendererConfig` as a dict (e.g. `{"name": "default"}`).
    Other keys are chat-template kwargs passed on to the inner renderer."""

    model_config = ConfigDict(frozen=True, extra="allow")

    inner: dict[str, Any]
    _internal_fields = frozenset({"inner"})
    _allow_opaque_template_kwargs = True


def custom_config(inner: dict[str, Any]) -> dict[str, Any]:
    """The `renderers` config (a dict for `TrainClientConfig.renderer`) of a token-exact renderer around
    the renderer config `inner` (as `renderer_choice.choose_renderer` resolved it)."""
    return {"name": "custom", "import_path": IMPORT_PATH, "inner": dict(inner)}


class TokenExactRenderer:
    """A renderer that delegates to `inner` and bridges every turn it can (module docstring)."""

    config_class = TokenExactRendererConfig

    def __init__(self, tokenizer: Any, config: TokenExactRendererConfig) -> None:
        from pydantic import TypeAdapter
        from renderers import RendererConfig, create_renderer

        inner_config = TypeAdapter(RendererConfig).validate_python(config.inner)
        kwargs = dict(config.model_extra or {})
        self._inner = create_renderer(tokenizer, inner_config, chat_template_kwargs=kwargs or None)
        self._tokenizer = tokenizer
        self.config = config

    def __getattr__(self, name: str) -> Any:
        # everything but the bridge is the inner renderer's (render, parse_response, stop ids, ...)
        return getattr(self.__dict__["_inner"], name)

    @property
    def inner(self) -> Any:
        return self._inner

    @property
    def is_multimodal(self) -> bool:
        """The inner renderer's answer (`renderers.base.is_multimodal` caches per type otherwise, and
        every wrapper has this one type)."""
        from renderers.base import is_multimodal

        return is_multimodal(self._inner)

    def bridge_to_next_turn(
        self,
        previous_prompt_ids: list[int],
        previous_completion_ids: list[int],
        new_messages: list[Any],
        *,
        tools: list[Any] | None = None,
        **kwargs: Any,
    ) -> RenderedTokens | None:
        """`prev_prompt + prev_completion + suffix(new_messages)`; None when it cannot (docstring)."""
        bridged = self._inner.bridge_to_next_turn(
            previous_prompt_ids, previous_completion_ids, new_messages, tools=tools, **kwargs
        )
        if bridged is not None or kwargs.get("previous_multi_modal_data") is not None:
            return bridged
        prefix = [*previous_prompt_ids, *previous_completion_ids]
        suffix = self.suffix(previous_completion_ids, new_messages, tools=tools)
        if suffix is None:
            return None
        ids, indices = suffix
        return RenderedTokens(
            token_ids=[*prefix, *ids],
            message_indices=[-1] * len(prefix) + indices,
            message_roles=[_role(m) for m in new_messages],
            message_tool_names=[None] * len(new_messages),
        )

    def suffix(
        self, completion_ids: list[int], new_messages: list[Any], *, tools: list[Any] | None = None
    ) -> tuple[list[int], list[int]] | None:
        """(token ids, new-message index per token) appended after a sampled completion; None when
        the template cannot be probed (see `suffix_text`)."""
        probe = suffix_text(self._render_text, new_messages, tools=tools)
        if probe is None:
            return None
        text, bounds = probe
        skip = self._sampled_close(completion_ids, text)
        return tokenize_suffix(self._tokenizer, text, bounds, skip)

    def _sampled_close(self, completion_ids: list[int], text: str) -> int:
        """How many characters at the start of the suffix the completion already holds: the text of its
        final stop token when the template's close opens with it (0 otherwise)."""
        if not completion_ids:
            return 0
        stops = set(self._inner.get_stop_token_ids())
        eos = getattr(self._tokenizer, "eos_token_id", None)
        if eos is not None:
            stops.add(eos)
        last = completion_ids[-1]
        if last not in stops:
            return 0
        stop_text = self._tokenizer.decode([last], skip_special_tokens=False)
        return len(stop_text) if stop_text and text.startswith(stop_text) else 0

    def _render_text(self, messages: list[dict[str, Any]], tools: Any, add_generation_prompt: bool) -> str:
        ids = self._inner.render_ids(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        return self._tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _role(message: Any) -> str:
    return (message.get("role") if isinstance(message, dict) else getattr(message, "role", "")) or ""


def suffix_text(
    render_text: Any, new_messages: list[Any], *, tools: list[Any] | None = None
) -> tuple[str, list[int]] | None:
    """The template's text after an assistant turn whose content is MARK, through `new_messages` and the
    generation prompt, with `bounds[i]` = where the text of `new_messages[i]` starts (bounds[n] = where
    the generation prompt starts). `render_text(messages, tools, add_generation_prompt)` renders a chat
    to text. None when a probe render fails or the renders are not prefix-stable after MARK."""
    chat: list[Any] = [_PROBE_USER, {"role": "assistant", "content": MARK}]
    tails: list[str | None] = []
    try:
        for k in range(len(new_messages) + 1):
            tails.append(_after_mark(render_text([*chat, *new_messages[:k]], tools, False)))
        full = _after_mark(render_text([*chat, *new_messages], tools, True))
    except Exception:  # tolerated: a template that refuses the probe chat -> no bridge (fresh render)
        return None
    texts = [t for t in [*tails, full] if t is not None]
    if len(texts) != len(tails) + 1 or any(not b.startswith(a) for a, b in itertools.pairwise(texts)):
        return None
    return texts[-1], [len(t) for t in texts[:-1]]


def _after_mark(text: str) -> str | None:
    at = text.find(MARK)
    return None if at < 0 else text[at + len(MARK) :]


def tokenize_suffix(tokenizer: Any, text: str, bounds: list[int], skip: int) -> tuple[list[int], list[int]]:
    """Tokenize `text[skip:]` alone (special tokens parsed, none added) and attribute each token to the
    new message whose text it starts in (`bounds` as `suffix_text` gives them), -1 outside any."""
    body = text[skip:]
    if not body:
        return [], []
    enc = tokenizer(body, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    indices = []
    for start, _end in enc["offset_mapping"]:
        pos = start + skip
        index = -1
        for i in range(len(bounds) - 1):
            if bounds[i] <= pos < bounds[i + 1]:
                index = i
        indices.append(index)
    return ids, indices
