"""Build a tiny random Qwen3-style causal LM and a BPE tokenizer, fully offline.

Used by tests, benchmarks and `configs/tiny/`. The tokenizer is trained with `tokenizers` on text this
module generates itself, so nothing is downloaded. Output is a plain HF directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a Qwen3-style ChatML chat template) that
`AutoModelForCausalLM` / `AutoTokenizer` load with `HF_HUB_OFFLINE=1`.

The tokenizer speaks tools the Qwen3 way: Qwen3's special tokens (`<think>`, `<tool_call>`,
`<tool_response>`, ...) are added after the BPE vocabulary (so the ids of the BPE tokens and of
`<|endoftext|>`, `<|im_start|>`, `<|im_end|>` are those of the tool-less tokenizer), and the chat template
renders `tools`, assistant `tool_calls` and `tool` messages in Qwen3's layout; verifiers' `qwen3`
renderer accepts it.

Invariant: the same `seed` gives byte-identical weights and tokenizer.
"""

from __future__ import annotations

import random
import string
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_TOOL_TOKENS = [
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]  # fmt: skip
"""Qwen3's tool/reasoning special tokens, appended after the BPE vocabulary (ids 1024.. at defaults)."""
CHATML_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n\' }}'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and tools and loop.first %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '\n<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] if call['function']['arguments'] is string "
    "else (call['function']['arguments'] | tojson) }}{{ '}\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_WORDS = (  # noqa: SIM905 (one readable block of words)
    "the a of to and in is it you that he was for on are with as his they be at one have this from or "
    "had by word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long make thing "
    "see him two has look more day could go come did number sound no most people my over know water than "
    "call first who may down side been now find reverse text answer add sum calculator tool result "
    "system user assistant please string letters digits plus minus times equals question"
).split()


def _corpus(seed: int, num_lines: int = 4000) -> list[str]:
    """Synthetic English-ish text plus random strings, digits and arithmetic: enough for a 1k BPE."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        noise = "".join(rng.choice(string.ascii_letters) for _ in range(rng.randint(2, 10)))
        expr = f"{rng.randint(0, 999)} {rng.choice('+-*')} {rng.randint(0, 999)} = {rng.randint(0, 9999)}"
        lines.append(" ".join(words) + f" {noise} {noise[::-1]} {expr}.")
    return lines


def build_tokenizer(out_dir: Path, *, vocab_size: int = 1024, seed: int = 0):
    """Train a byte-level BPE tokenizer offline and save it as an HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    # Appended after the trained vocabulary: the BPE ids stay those of the tool-less tokenizer.
    hf_tok.add_special_tokens(
        {"additional_special_tokens": QWEN3_TOOL_TOKENS}, replace_extra_special_tokens=False
    )
    hf_tok.chat_template = CHATML_TEMPLATE
    hf_tok.save_pretrained(out_dir)
    return hf_tok


def _tokenizer_and_shared_config(
    out: Path, *, vocab_size: int, seed: int, hidden_size: int, num_layers: int, num_heads: int,
    num_kv_heads: int, max_positions: int,
) -> dict:  # fmt: skip
    """Write the tokenizer into `out`; return the config fields the dense and MoE tiny models share
    (vocabulary, attention, special tokens)."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, vocab_size=vocab_size, seed=seed)
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 3,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.pad_token_id,
    }


def _write_model(out: Path, model_cls, config, seed: int) -> Path:
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    return out


def build_tiny_model(
    out_dir: str | Path,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 128,
    num_layers: int = 3,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 2048,
    seed: int = 0,
) -> Path:
    """Write a tiny random Qwen3ForCausalLM (~0.9M params) plus tokenizer into `out_dir`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    shared = _tokenizer_and_shared_config(
        out, vocab_size=vocab_size, seed=seed, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, max_positions=max_position_embeddings,
    )  # fmt: skip
    return _write_model(out, Qwen3ForCausalLM, Qwen3Config(**shared), seed)


def build_tiny_moe_model(
    out_dir: str | Path,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 128,
    num_layers: int = 3,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    num_experts: int = 4,
    experts_per_token: int = 2,
    max_position_embeddings: int = 2048,
    seed: int = 0,
) -> Path:
    """Write a tiny random Qwen3-MoE causal LM (every layer sparse: `num_experts` SwiGLU experts, top-k
    routing with normalised top-k weights) plus the same tokenizer as `build_tiny_model` into `out_dir`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = Path(out_dir)
    shared = _tokenizer_and_shared_config(
        out, vocab_size=vocab_size, seed=seed, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, max_positions=max_position_embeddings,
    )  # fmt: skip
    config = Qwen3MoeConfig(
        **shared,
        moe_intermediate_size=hidden_size,
        num_experts=num_experts,
        num_experts_per_tok=experts_per_token,
        norm_topk_prob=True,
        decoder_sparse_step=1,
    )
    return _write_model(out, Qwen3MoeForCausalLM, config, seed)
