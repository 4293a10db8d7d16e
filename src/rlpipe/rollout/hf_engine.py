"""HF ``generate`` engine: the fallback when vLLM is not installed or not wanted (``rollout.engine: hf``).

It runs where the trainer runs: on CUDA when a GPU is present, in bfloat16 there (as vLLM's ``dtype="auto"``
serves a float32 checkpoint in 16 bits on a GPU), and on CPU in float32 otherwise."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from rlpipe.rollout.base import Completion, Digest, SamplingConfig, WeightSyncError, resolved
from rlpipe.tokens import eos_ids, folder_eos_ids
from rlpipe.storage.weights import file_weights_digest, load_safetensors_folder, weights_digest
from rlpipe.training.checkpoint import load_checkpoint


class HFEngine:
    name = "hf"

    def __init__(self, model_dir: str | Path, batch_size: int = 256, device: str | None = None,
                 dtype: torch.dtype | None = None, stop_tokens: list[int | str] | None = None, **_: object):
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
        self.model, self.tokenizer, _ = load_checkpoint(model_dir, dtype=dtype)
        self.model.to(dev).eval()
        self.batch_size = batch_size
        self._sha = file_weights_digest(model_dir)
        self.stop_ids = folder_eos_ids(model_dir, self.tokenizer, stop_tokens)

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer: object, batch_size: int = 256) -> "HFEngine":
        """An engine over a model in memory (e.g. evaluation during SFT); it shares the model's weights."""
        self = cls.__new__(cls)
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.stop_ids = eos_ids(model.generation_config.eos_token_id, tokenizer)
        self._sha = weights_digest(model.state_dict())
        return self

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        eos = self.stop_ids
        pad, dev = self.tokenizer.pad_token_id, self.device
        flat = [(i, p) for i, p in enumerate(prompts) for _ in range(sampling.n)]
        out: list[list[Completion]] = [[] for _ in prompts]
        gens = self._generators(len(prompts), sampling)
        for start in range(0, len(flat), self.batch_size):
            chunk = flat[start : start + self.batch_size]
            width = max(len(p) for _, p in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            att = torch.zeros_like(ids)
            for j, (_, p) in enumerate(chunk):  # left padding
                ids[j, width - len(p) :] = torch.tensor(p)
                att[j, width - len(p) :] = 1
            seqs = self._sample(ids.to(dev), att.to(dev), sampling, eos, [gens[start + j] for j in range(len(chunk))])
            for (i, _), (toks, lps, reason) in zip(chunk, seqs):
                out[i].append(Completion(toks, lps, self.tokenizer.decode(toks, skip_special_tokens=True), reason))
        return out

    @staticmethod
    def _generators(n_prompts: int, sampling: SamplingConfig) -> list[torch.Generator]:
        """One generator per completion, seeded from ``seed + prompt index`` and the sample's number (vLLM seeds
        each prompt of a request apart too): a completion's tokens do not depend on how the prompts are batched
        or split across replicas."""
        base = sampling.seed if sampling.seed is not None else torch.seed()
        return [torch.Generator().manual_seed(((base + i) * 1_000_003 + s) % 2**63)
                for i in range(n_prompts) for s in range(sampling.n)]

    def _sample(self, ids, att, sampling, eos, gens):
        # A plain sampling loop with a KV cache: explicit, so the log-probs are exactly those of the
        # temperature/top-p distribution that drew each token.
        n = ids.shape[0]
        pos = (att.cumsum(-1) - 1).clamp_min(0)
        out = self.model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
        toks: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        done = [False] * n
        next_pos = pos[:, -1] + 1
        for _ in range(sampling.max_new_tokens):
            if sampling.temperature == 0:
                choice = logits.argmax(-1)
                lp = torch.zeros(n, device=logits.device)
            else:
                scaled = logits.float() / sampling.temperature
                probs = scaled.softmax(-1)
                if sampling.top_p < 1.0:
                    sp, si = probs.sort(-1, descending=True)
                    keep = sp.cumsum(-1) - sp < sampling.top_p
                    sp = sp * keep
                    probs = torch.zeros_like(probs).scatter_(-1, si, sp)
                    probs = probs / probs.sum(-1, keepdim=True)
                choice = _draw(probs, gens)
                lp = probs.gather(-1, choice[:, None]).squeeze(-1).log()
            chosen, chosen_lp = choice.tolist(), lp.tolist()  # one device-to-host copy per step
            for j in range(n):
                if not done[j]:
                    toks[j].append(chosen[j])
                    lps[j].append(chosen_lp[j])
                    done[j] = chosen[j] in eos
            if all(done):
                break
            att = torch.cat([att, torch.ones(n, 1, dtype=att.dtype, device=att.device)], -1)
            out = self.model(input_ids=choice[:, None], attention_mask=att, position_ids=next_pos[:, None],
                             past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1]
            next_pos = next_pos + 1
        return [(t, lp, "stop" if t and t[-1] in eos else "length") for t, lp in zip(toks, lps)]

    def load_weights(self, folder: str | Path) -> str:
        tensors = load_safetensors_folder(folder)
        if not tensors:
            raise WeightSyncError(f"{folder} holds no *.safetensors weights")
        return self.load_tensors(tensors, weights_digest(tensors), where=str(folder))

    @torch.no_grad()
    def load_tensors(self, tensors: Mapping[str, torch.Tensor], sha256: Digest, where: str = "the handed tensors") -> Digest:
        """Copied into the engine's own modules (never shared: the trainer changes its weights while this engine
        may still generate with the last ones); the caller hashed them once (``sha256``, or a future of it)."""
        if not tensors:
            raise WeightSyncError("no tensors handed over")
        missing, unexpected = self.model.load_state_dict(dict(tensors), strict=False)
        if unexpected or any(k for k in missing if "lm_head" not in k):
            raise WeightSyncError(f"weights in {where} do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
        if self.model.config.tie_word_embeddings:
            self.model.tie_weights()
        # Read back from the model itself, every tensor, against what was fed cast to the engine's dtype (a 16-bit
        # engine holds the rounded weights); the version is the hash of what was fed, as vLLM's engine reports.
        held = self.model.state_dict()
        differ = [k for k, t in tensors.items() if not torch.equal(held[k], t.to(held[k].device, held[k].dtype))]
        if differ:
            raise WeightSyncError(f"after reload the engine holds different values for {differ[:5]}")
        self._sha = sha256  # a future is waited for by weights_sha256()
        self.last_readback = len(tensors)
        return self._sha

    @torch.no_grad()
    def sequence_logprobs(self, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[float]]:
        """log π(c_t | prompt, c_<t) of each continuation token at temperature 1 (the weight-sync probe)."""
        out = []
        for p, c in zip(prompts, continuations):
            logits = self.model(input_ids=torch.tensor([p + c], device=self.device)).logits[0, :-1].float()
            lp = logits.log_softmax(-1)
            out.append([float(lp[len(p) - 1 + j, tok]) for j, tok in enumerate(c)])
        return out

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def weights_sha256(self) -> str:
        return resolved(self._sha)

    def close(self) -> None:
        del self.model


def _draw(probs: torch.Tensor, gens: list[torch.Generator]) -> torch.Tensor:
    """One token per row, each drawn with its completion's own (CPU) generator. On CPU: torch's multinomial per
    row. On a GPU, where a kernel per row would cost more than the model: one uniform per row from its
    generator, then the inverse CDF of the whole batch on the device (side='right' never lands on a token of
    probability 0)."""
    if probs.device.type == "cpu":
        return torch.cat([torch.multinomial(probs[j], 1, generator=g) for j, g in enumerate(gens)])
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in gens]).to(probs.device)
    cdf = probs.double().cumsum(-1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
    return picked.clamp_max(probs.shape[-1] - 1)
