"""MoE routing replay (R3) in the fsdp backend: the trainer's MoE layers route each token to the experts
the engine routed it to when it was generated.

Without replay the trainer recomputes the routing; a token whose router scores are close can land on
other experts than in the sampler, and the importance ratio then measures routing noise, not the policy
change. With replay (`trainer.router_replay`), each micro-batch's `routed_experts` (one row per token,
layer-major, -1 = unknown) is installed for its forward and backward (`RouterReplay.replaying`: activation
checkpointing runs the forward again in the backward), and every router module of the model:

- computes its own softmax probabilities as usual (so the router weights still get gradients),
- takes the recorded experts instead of its own top-k for the tokens that have them (its own top-k for
  the rest: -1 rows, e.g. a sequence's last token, which the engine never ran),
- weights them by its own probabilities at those experts (renormalised when the model normalises top-k).

Invariant: with identical weights, replayed routing makes the trainer's forward equal the engine's
(tests/trainer/test_router_replay.py: logprobs equal to fp32 precision at version 0).
`moe/routing_agreement` is the fraction of (token, layer) pairs with recorded experts where the trainer's
own top-k is the same set as the recorded one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import MethodType

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from prime_async.trainer.token_stats import reduce_device


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k router modules of an HF MoE model, in layer order (transformers' Qwen3-MoE family: a
    `weight` of (experts, hidden), `top_k` and `norm_topk_prob`)."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k") and hasattr(m, "weight")
    ]


class RouterReplay:
    """Installed once on the model (before FSDP wrapping); replays routes inside `replaying`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError("router_replay = true needs an MoE model (this model has no top-k routers)")
        self._routes: torch.Tensor | None = None  # (T, layers, k) during a replayed forward
        self._counts: torch.Tensor | None = None  # (agreeing, replayed) routes, on the model's device
        for layer, router in enumerate(self.routers):
            router.forward = MethodType(_make_forward(self, layer), router)

    @property
    def width(self) -> int:
        return len(self.routers) * int(self.routers[0].top_k)

    @contextmanager
    def replaying(self, routes: np.ndarray | None, device: torch.device) -> Iterator[None]:
        """Replay `routes` ((T, layers * k), -1 = unknown) in the forwards run inside the block."""
        if routes is None:
            yield
            return
        if routes.shape[1] != self.width:
            raise ValueError(
                f"routed_experts have {routes.shape[1]} experts per token, the model routes {self.width} "
                f"({len(self.routers)} MoE layers x top-{self.routers[0].top_k}): the engine's model differs"
            )
        k = int(self.routers[0].top_k)
        self._routes = torch.from_numpy(np.asarray(routes, dtype=np.int64)).reshape(-1, len(self.routers), k)
        self._routes = self._routes.to(device)
        try:
            yield
        finally:
            self._routes = None

    def _route(self, router, layer: int, hidden: torch.Tensor):
        hidden = hidden.reshape(-1, router.weight.shape[1])
        logits = F.linear(hidden, router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        own = probs.topk(router.top_k, dim=-1).indices
        chosen = own
        if self._routes is not None:
            recorded = self._routes[:, layer, :]
            if recorded.shape[0] != own.shape[0]:
                raise ValueError(f"routed_experts of {recorded.shape[0]} tokens, forward of {own.shape[0]}")
            known = (recorded >= 0).all(dim=-1)
            chosen = torch.where(known[:, None], recorded, own)
            with torch.no_grad():  # no host sync here: the counts are read in `metrics`
                same = (own.sort(-1).values == recorded.sort(-1).values).all(-1) & known
                counts = torch.stack([same.sum(), known.sum()]).double()
                self._counts = counts if self._counts is None else self._counts + counts
        weights = probs.gather(-1, chosen)
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), chosen

    def metrics(self) -> dict[str, float]:
        """`moe/routing_agreement` (and the count behind it) since the last call, summed over ranks."""
        counts = self._counts if self._counts is not None else torch.zeros(2, dtype=torch.float64)
        self._counts = None
        if dist.is_initialized():
            counts = counts.to(reduce_device())
            dist.all_reduce(counts)
        agree, known = (float(x) for x in counts.cpu())
        if known == 0:
            return {}
        return {"moe/routing_agreement": agree / known, "moe/replayed_routes": known}


def _make_forward(replay: RouterReplay, layer: int):
    def forward(router, hidden_states: torch.Tensor):
        return replay._route(router, layer, hidden_states)

    return forward
