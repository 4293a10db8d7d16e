"""The output layer in chunks (``train.logits_chunk``): the log-probs and entropy of a response's positions with
the logits of at most ``chunk`` positions in memory at once.

Each chunk's logits are computed, reduced to a log-prob and an entropy per position, and dropped; the backward
recomputes them (torch's activation checkpointing) instead of keeping them. It is what Liger's fused linear
cross-entropy does in a GPU kernel, in plain torch: at a hub vocabulary (151,936 columns, float32) the logits of
2,048 response positions are 1.2 GB per copy, and the log-softmax, its backward and the entropy each make one;
chunked, a chunk's. The price: the output layer's matrix product once more in the backward.

It computes the logits as ``get_output_embeddings()(hidden)``; a model that changes them after its output layer
(a logit scale or soft cap) would be trained on other numbers, so :func:`check_chunked_head` proves the two equal
on the model before a run uses it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from rlpipe.training.packing import logits_at

__all__ = ["check_chunked_head", "chunked_logprobs"]


def _chunk(head: Any, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
           entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = logits.log_softmax(-1)
    picked = logp.gather(-1, targets[:, None]).squeeze(-1)
    return picked, (-(logp.exp() * logp).sum(-1) if entropy else picked[:0])


def chunked_logprobs(head: Any, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, chunk: int,
                     entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(target) at each of ``hidden``'s n positions (n, d) and, with ``entropy``, the entropy there, from the
    logits of ``chunk`` positions at a time. Where a gradient is being built, each chunk is checkpointed: its
    logits are recomputed in the backward, never kept."""
    keep = torch.is_grad_enabled() and hidden.requires_grad
    picked, ents = [], []
    for start in range(0, hidden.shape[0], chunk):
        args = (head, hidden[start : start + chunk], targets[start : start + chunk], temperature, entropy)
        lp, ent = checkpoint(_chunk, *args, use_reentrant=False) if keep else _chunk(*args)
        picked.append(lp)
        ents.append(ent)
    if not picked:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty if entropy else None
    return torch.cat(picked), torch.cat(ents) if entropy else None


@torch.no_grad()
def check_chunked_head(model: Any, where: str) -> float:
    """Proof that ``model``'s logits are its output layer's alone (what the chunks compute): the model's own logits
    and ``get_output_embeddings()`` applied to its final hidden states agree on a short sequence; else a clear
    error rather than a run trained on other numbers. The largest gap."""
    module = getattr(model, "module", model)
    vocab = int(module.get_input_embeddings().num_embeddings)
    ids = torch.tensor([[(3 + 5 * k) % vocab for k in range(6)]], device=next(module.parameters()).device)
    was_training = module.training
    module.eval()
    try:
        full = module(input_ids=ids).logits[0].float()
        with logits_at(module, torch.arange(6, device=ids.device), hold=True) as held:
            module(input_ids=ids)
        own = held.head(held.hidden).float()
    finally:
        module.train(was_training)
    gap = float((own - full).abs().max())
    tol = 1e-4 if next(module.parameters()).dtype == torch.float32 else 5e-2
    if not gap <= tol:
        raise ValueError(f"{where}: this model changes its logits after its output layer (they differ from "
                         f"get_output_embeddings()'s by {gap:.3g}: a logit scale or soft cap), which the chunked "
                         "output layer leaves out; set train.logits_chunk: null")
    return gap
