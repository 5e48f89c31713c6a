"""The trainer's side of the check after every weight load: the probe and its reference logprobs.

    Trainer.publish(N) ──► backend.probe_logits(probe.sequences) (collective, the trainer's own forward)
        ──► ProbeBuilder.reference(logits) ──► publisher.attach_probe(N, ref) ──► Published(N, probe=ref)

Invariants: the probe's sequences are fixed for the run (fixed texts, encoded by the model's own
tokenizer, cut or repeated to `tokens` tokens); the reference is computed from the parameters being
published (before any later optimizer step), at temperature 1, in float32 from the backend's logits.
"""

from __future__ import annotations

import torch

from prime_async.config.probe import WeightProbeConfig
from prime_async.weights.probe import ProbeDist, ProbeReference

PROBE_TEXTS = (
    "The capital of France is Paris, and the capital of Italy is Rome. The river through Paris is",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5\n",
    "Question: what is 12 times 7? Answer: 12 times 7 is 84, because 12 times 7 equals",
    "Once upon a time there was a small robot who wanted to learn how to paint the sea.",
)


def probe_sequences(tokenizer, cfg: WeightProbeConfig) -> list[list[int]]:
    """`cfg.sequences` sequences of exactly `cfg.tokens` ids of `tokenizer` (texts repeated as needed)."""
    out = []
    for i in range(cfg.sequences):
        ids = tokenizer.encode(PROBE_TEXTS[i % len(PROBE_TEXTS)], add_special_tokens=False)
        if not ids:
            raise ValueError("the tokenizer encodes the probe text to no tokens")
        out.append((ids * (cfg.tokens // len(ids) + 1))[: cfg.tokens])
    return out


class ProbeBuilder:
    """The run's probe (`sequences`) and the reference of one version from the trainer's logits."""

    def __init__(self, cfg: WeightProbeConfig, sequences: list[list[int]]):
        self.cfg, self.sequences = cfg, sequences

    @staticmethod
    def from_model_path(cfg: WeightProbeConfig, model_path: str) -> ProbeBuilder:
        from transformers import AutoTokenizer

        return ProbeBuilder(cfg, probe_sequences(AutoTokenizer.from_pretrained(model_path), cfg))

    def reference(self, logits: list[torch.Tensor]) -> ProbeReference:
        """`logits[i]`: (len(sequences[i]), V), position p predicting token p + 1."""
        logprobs, dists = [], []
        for i, (seq, lg) in enumerate(zip(self.sequences, logits, strict=True)):
            lp = torch.log_softmax(lg.float(), dim=-1)  # (T, V)
            targets = torch.tensor(seq[1:], device=lp.device)[:, None]
            logprobs.append(lp[:-1].gather(1, targets)[:, 0].tolist())
            for pos in range(max(1, len(seq) - self.cfg.positions), len(seq)):
                top = lp[pos - 1].topk(min(self.cfg.top_k, lp.shape[-1]))
                dists.append(ProbeDist(i, pos, top.indices.tolist(), top.values.tolist()))
        return ProbeReference([list(s) for s in self.sequences], logprobs, dists, self.cfg.top_k)


def probe_logits(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Logits (T, V) of every position of each sequence through an HF causal LM (collective under FSDP:
    every rank calls it with the same sequences)."""
    from prime_async.utils.devices import model_device

    device = model_device(model)
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor(seq, device=device)[None]
            out.append(model(input_ids=ids, use_cache=False).logits[0].float())
    return out
