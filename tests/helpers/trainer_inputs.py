"""Eight scored samples of the tiny checkpoint with their log-probs from a plain float32 CPU forward: the reference
an update's mismatch is measured against (tests of the trainer on CUDA and in bf16)."""

from __future__ import annotations

import torch

from rlpipe.storage.samples import Sample

PROMPTS = [[5 + i, 6, 7, 8][: 2 + i % 3] for i in range(8)]
RESPONSES = [[10 + i, 11, 12, 13, 14][: 1 + (i * 2) % 5] for i in range(8)]
REWARDS = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]


def scored_samples(logprobs: list[list[float]], prompts=PROMPTS, responses=RESPONSES) -> list[Sample]:
    return [Sample(p, r, lp, REWARDS[i], i // 4) for i, (p, r, lp) in enumerate(zip(prompts, responses, logprobs))]


@torch.no_grad()
def cpu_logprobs(model, pad_id: int, prompts=PROMPTS, responses=RESPONSES) -> list[list[float]]:
    from rlpipe.algorithms.functional import token_logprobs
    from rlpipe.training.packing import collate

    micro = collate([Sample(p, r, [0.0] * len(r), 0.0, 0) for p, r in zip(prompts, responses)], {}, pad_id)
    lp = token_logprobs(model(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits[:, :-1], micro.targets)
    return [lp[i, len(p) - 1 : len(p) - 1 + len(r)].tolist() for i, (p, r) in enumerate(zip(prompts, responses))]
