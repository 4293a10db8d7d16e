"""How a micro-batch's sequences are laid out for the forward pass: padded, packed, or with shared prompts.

:func:`collate` pads prompt+response sequences into a :class:`MicroBatch` and places the per-token values (old
log-probs, advantages, …) at the positions that predict the tokens they belong to. With ``train.pack_sequences``
it also lays the same sequences end to end in rows (:func:`pack_rows`; position ids restart at each sequence) wherever
that computes PACK_MIN_SAVING fewer positions than padding; with ``train.share_prompts`` samples with the same
prompt (a GRPO group) share one copy of it (:func:`pack_shared`: each response attends to the prompt and to
itself, an explicit attention mask). The losses are computed in the padded layout either way
(:meth:`MicroBatch.unpack` and :meth:`MicroBatch.scatter`), and :func:`check_packing` proves that a model's
forward honours the packed layouts before any of it is trusted. :func:`token_bins` cuts samples into micro-batches
by a token budget.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from rlpipe.storage.samples import Sample

__all__ = ["PACK_MIN_SAVING", "PACK_ROW", "SHARE_UNIT", "HeldHidden", "MicroBatch", "Packing", "check_packing", "collate", "pack_rows",
           "logits_at", "pack_shared", "prompt_units", "token_bins"]

# A packed row holds at least this many tokens: rows of sequences, not one short sequence per row (the
# attention's per-row cost dominates at a few tokens per sequence). 64 came out of an informal sweep of 16–256
# on the demo's batch shapes (not kept); benchmarks/packing.py measures this value.
PACK_ROW = 64
# Packing is used where it computes at least this share fewer positions than padding.
PACK_MIN_SAVING = 0.1
# A shared prompt and the responses after it (a 'unit') hold at most this many tokens unless one sequence is longer,
# and a row of units is at least this wide: attention over a row is dense (an explicit mask), so a long unit would
# trade the prompt's linear work for attention work. From an informal sweep on the demo's shapes (not kept): with
# whole groups per micro-batch, rows of 64 left more tail padding than rows of 256 (352 against 283 positions);
# with the default shuffle, 64, 128 and 256 were within the machine's noise.
SHARE_UNIT = 256

@dataclass
class Packing:
    """The micro-batch's sequences laid end to end in rows (position ids restart at each sequence, so the
    model attends within a sequence only): the forward computes no padding but the rows' short tails."""

    input_ids: torch.Tensor  # (R, C)
    position_ids: torch.Tensor  # (R, C)
    src: torch.Tensor  # flat indices in (R, C-1) of every position that predicts a token of its own sequence
    dst: torch.Tensor  # the same positions' flat indices in the padded (b, L-1) layout
    # Shared prompts: (R, 1, C, C), True where a query position may attend to a key position; src may then
    # repeat (a shared prompt's last position predicts every response's first token). None: position ids
    # alone keep the sequences apart.
    attention_mask: torch.Tensor | None = None

    def to(self, device: torch.device) -> "Packing":
        return Packing(*(t.to(device) for t in (self.input_ids, self.position_ids, self.src, self.dst)),
                        None if self.attention_mask is None else self.attention_mask.to(device))


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # (b, L)
    attention_mask: torch.Tensor  # (b, L)
    targets: torch.Tensor  # (b, L-1) next-token ids
    mask: torch.Tensor  # (b, L-1) 1 where the target is a trained response token
    action: torch.Tensor  # (b, L-1) 1 on the policy's response tokens (the critic's mask)
    resp: torch.Tensor  # (b, L-1) 1 where a response token is predicted (the policy's and the environment's)
    tok: dict[str, torch.Tensor]  # (b, L-1) per-token inputs: old_logprobs, advantages, ref_logprobs, …
    packed: Packing | None = None  # train.pack_sequences, where it saves: the layout the forward passes run in

    def to(self, device: torch.device) -> "MicroBatch":
        """The same micro-batch on ``device`` (the engine's: CPU, or the rank's GPU)."""
        if self.input_ids.device == device:
            return self
        packed = self.packed and self.packed.to(device)
        return MicroBatch(self.input_ids.to(device), self.attention_mask.to(device), self.targets.to(device),
                          self.mask.to(device), self.action.to(device), self.resp.to(device),
                          {k: v.to(device) for k, v in self.tok.items()}, packed)

    @cached_property
    def predicting(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position that predicts a response token: its flat index in the forward's input, (b, L) padded or
        (R, C) packed (what :func:`logits_at` takes), and its flat index in the padded (b, L-1) layout (what
        :meth:`scatter` takes), in the same order. A shared prompt's last position repeats (it predicts each
        of its responses' first token)."""
        where = self.resp.reshape(-1) > 0
        if self.packed is None:
            dst = where.nonzero().squeeze(1)
            src, width = dst, self.input_ids.shape[1]
        else:
            keep = where[self.packed.dst]
            src, dst, width = self.packed.src[keep], self.packed.dst[keep], self.packed.input_ids.shape[1]
        return src // (width - 1) * width + src % (width - 1), dst

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """A per-position (R, C-1, …) tensor of the packed forward in the padded (b, L-1, …) layout (0 elsewhere);
        gradients flow through."""
        if self.packed is None:
            return x
        return self.scatter(x.reshape(-1, *x.shape[2:])[self.packed.src])

    def scatter(self, x: torch.Tensor, dst: torch.Tensor | None = None) -> torch.Tensor:
        """Values (n, …) at the positions ``dst`` (flat in the padded layout; default: the packed layout's
        predicting positions, in ``src`` order) in the padded (b, L-1, …) layout (0 elsewhere); gradients flow
        through."""
        rest = x.shape[1:]
        flat = torch.zeros((self.targets.numel(), *rest), dtype=x.dtype, device=x.device)
        return flat.index_put((self.packed.dst if dst is None else dst,), x).view(*self.targets.shape, *rest)


@dataclass
class HeldHidden:
    """What :func:`logits_at` with ``hold`` kept: the gathered hidden states (n, d), for the caller to apply the
    output layer to itself (in chunks, :func:`rlpipe.training.head.chunked_logprobs`)."""

    hidden: torch.Tensor | None = None
    head: Any = None


@contextmanager
def logits_at(model: Any, at: torch.Tensor, hold: bool = False) -> Iterator[HeldHidden]:
    """Within, ``model``'s output layer (``get_output_embeddings()``) computes logits only at ``at``: flat indices
    into its input's (rows, positions), in that order, returned as (1, n, vocabulary). At a hub vocabulary
    (150k) the output layer is a quarter of a 0.5B model's forward and its logits the largest activations; a
    prompt's positions need none. ``hold``: the output layer computes none at all; the model's "logits" come back
    as the gathered hidden states themselves, (1, n, d), also kept in what this yields, for the caller to apply the
    output layer to. They are the model's output, so the backward reaches the model's output first (as DeepSpeed's
    engine needs: its output hooks start each backward, and its bf16 optimizer clears the last micro-batch's
    gradients there). Only in the calling thread (the trainer's probe may run on another). ``model``: an HF causal
    LM, or a DeepSpeed engine or peft model around one."""
    head = getattr(model, "module", model).get_output_embeddings()
    owner, held = threading.get_ident(), HeldHidden(head=head)

    def take(_module: Any, args: tuple) -> tuple | None:
        if threading.get_ident() != owner:
            return None
        h = args[0]
        picked = h.reshape(-1, h.shape[-1]).index_select(0, at)
        if hold:
            held.hidden, picked = picked, picked[:0]
        return (picked.unsqueeze(0), *args[1:])

    def hand_back(_module: Any, _args: tuple, _out: Any) -> Any:
        if threading.get_ident() != owner or held.hidden is None:
            return None
        return held.hidden.unsqueeze(0)

    handles = [head.register_forward_pre_hook(take)] + ([head.register_forward_hook(hand_back)] if hold else [])
    try:
        yield held
    finally:
        for handle in handles:
            handle.remove()


def _rows(lengths: Sequence[int], row: int) -> tuple[list[list[int]], int]:
    """ceil(tokens / max(longest, row)) rows, each item (longest first) into the least-filled row; the rows'
    members and their common width (the fullest row's load)."""
    n_rows = -(-sum(lengths) // max(max(lengths), row))
    rows: list[list[int]] = [[] for _ in range(n_rows)]
    load = [0] * n_rows
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        j = min(range(n_rows), key=load.__getitem__)
        rows[j].append(i)
        load[j] += lengths[i]
    return rows, max(load)


def pack_rows(seqs: Sequence[Sequence[int]], width: int, pad_id: int) -> Packing:
    """Sequences end to end in rows of at least PACK_ROW tokens (:func:`_rows`); a row's tail is padding with
    its own positions (a separate 'sequence' no real token attends to)."""
    lengths = [len(s) for s in seqs]
    rows, c = _rows(lengths, PACK_ROW)
    ids: list[int] = []  # built as flat lists, one tensor each at the end (per-sequence tensors cost more)
    pos: list[int] = []
    src: list[int] = []
    dst: list[int] = []
    for j, members in enumerate(rows):
        o = 0
        for i in members:
            n = lengths[i]
            ids.extend(seqs[i])
            pos.extend(range(n))
            src.extend(range(j * (c - 1) + o, j * (c - 1) + o + n - 1))
            dst.extend(range(i * (width - 1), i * (width - 1) + n - 1))
            o += n
        ids.extend([pad_id] * (c - o))
        pos.extend(range(c - o))
    shape = (len(rows), c)
    return Packing(torch.tensor(ids, dtype=torch.long).view(shape), torch.tensor(pos, dtype=torch.long).view(shape),
                    torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long))


def prompt_units(samples: Sequence[Sample]) -> list[tuple[list[int], list[int]]]:
    """The micro-batch's samples by prompt, in order of first appearance: (prompt ids, sample indices). A unit
    takes no more responses once it holds SHARE_UNIT tokens (the prompt then starts a new one)."""
    units: list[tuple[list[int], list[int]]] = []
    load: list[int] = []
    open_: dict[tuple[int, ...], int] = {}
    for i, s in enumerate(samples):
        key, n = tuple(s.prompt_ids), len(s.response_ids)
        u = open_.get(key)
        if u is None or load[u] + n > SHARE_UNIT:
            u = open_[key] = len(units)
            units.append((list(s.prompt_ids), []))
            load.append(len(s.prompt_ids))
        units[u][1].append(i)
        load[u] += n
    return units


def pack_shared(samples: Sequence[Sample], units: list[tuple[list[int], list[int]]], width: int, pad_id: int) -> Packing:
    """Each unit as one prompt followed by its responses, units in rows of at least SHARE_UNIT tokens (:func:`_rows`).
    A response's positions continue the prompt's; it attends to its prompt and to itself (the attention mask), so
    it computes what it would alone. Its first token is predicted at the prompt's last position."""
    lengths = [len(pr) + sum(len(samples[i].response_ids) for i in members) for pr, members in units]
    rows, c = _rows(lengths, SHARE_UNIT)
    ids: list[int] = []
    pos: list[int] = []
    unit: list[int] = []  # per position: its unit (a row's tail: a unit of its own per position)
    resp: list[int] = []  # per position: its sample, -1 on a prompt
    src: list[int] = []
    dst: list[int] = []
    for j, members in enumerate(rows):
        o = 0
        for u in members:
            prompt, which = units[u]
            n_p = len(prompt)
            ids += prompt
            pos += range(n_p)
            unit += [u] * n_p
            resp += [-1] * n_p
            last, o = j * (c - 1) + o + n_p - 1, o + n_p
            for i in which:
                r = samples[i].response_ids
                ids += r
                pos += range(n_p, n_p + len(r))
                unit += [u] * len(r)
                resp += [i] * len(r)
                src += [last, *range(j * (c - 1) + o, j * (c - 1) + o + len(r) - 1)][: len(r)]
                dst += range(i * (width - 1) + n_p - 1, i * (width - 1) + n_p - 1 + len(r))
                o += len(r)
        ids += [pad_id] * (c - o)
        pos += range(c - o)
        unit += range(-1, -1 - (c - o), -1)
        resp += [-1] * (c - o)
    shape = (len(rows), c)
    un, rs = torch.tensor(unit).view(shape), torch.tensor(resp).view(shape)
    mask = (torch.ones(c, c, dtype=torch.bool).tril() & (un[:, :, None] == un[:, None, :])
            & ((rs[:, None, :] == -1) | (rs[:, :, None] == rs[:, None, :])))
    return Packing(torch.tensor(ids, dtype=torch.long).view(shape), torch.tensor(pos, dtype=torch.long).view(shape),
                    torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long), mask[:, None])


@torch.no_grad()
def check_packing(model: Any, where: str, share: bool = False) -> float:
    """Proof that this model's forward honours the packed layouts: its outputs (logits, or a critic's values) at
    every position that predicts a response token equal their padded outputs for two sequences packed in one row
    (position ids) and, with ``share``, for three responses after one shared prompt (the attention mask); else
    a clear error rather than a loss that crosses sequence boundaries. The largest gap."""
    vocab = int(model.get_input_embeddings().num_embeddings)
    seqs = [[(3 + 5 * k) % vocab for k in range(6)], [(4 + 7 * k) % vocab for k in range(4)]]
    samples = [Sample(q[:2], q[2:], [0.0] * (len(q) - 2), 0.0, i) for i, q in enumerate(seqs)]
    layouts = [(samples, collate(samples, {}, 0, pack=True).packed, "train.pack_sequences: false")]
    if share:
        shared = [Sample(seqs[0][:3], r, [0.0] * len(r), 0.0, 0) for r in (seqs[1][:2], seqs[1][1:], seqs[0][3:4])]
        shared.append(samples[1])
        width = max(len(x.prompt_ids) + len(x.response_ids) for x in shared)
        layouts.append((shared, pack_shared(shared, prompt_units(shared), width, 0), "train.share_prompts: false"))
    was_training = model.training
    model.eval()
    worst = 0.0
    # A 16-bit model (a reference kept in its checkpoint's dtype) rounds its logits to ~3 digits: the probe's
    # 16-bit tolerance. Attention across a sequence boundary moves them by far more.
    tol = 1e-4 if next(model.parameters()).dtype == torch.float32 else 5e-2
    for group, p, fix in layouts:
        padded = collate(group, {}, 0)
        plain = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits[:, :-1]
        rows = model(input_ids=p.input_ids, position_ids=p.position_ids, attention_mask=p.attention_mask,
                     use_cache=False).logits[:, :-1]
        got = rows.reshape(-1, rows.shape[-1])[p.src]
        gap = float((got - plain.reshape(-1, plain.shape[-1])[p.dst]).abs().max())
        if not gap <= tol:
            model.train(was_training)
            raise ValueError(f"{where}: this model's forward does not keep packed sequences apart (outputs packed vs "
                             f"padded differ by {gap:.3g}); set {fix}")
        worst = max(worst, gap)
    model.train(was_training)
    return worst


def collate(samples: Sequence[Sample], per_token: dict[str, Sequence[Sequence[float]]], pad_id: int,
             train_masks: Sequence[Sequence[float]] | None = None, pack: bool = False, share: bool = False) -> MicroBatch:
    """Pad prompt+response sequences; place response-aligned values at the positions that predict them;
    ``pack``: also the packed layout of the same sequences, where it saves PACK_MIN_SAVING of the positions;
    ``share``: with one copy of each shared prompt, where that saves PACK_MIN_SAVING of the packed positions."""
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    ids = torch.tensor([q + [pad_id] * (width - len(q)) for q in seqs], dtype=torch.long)
    att = torch.tensor([[1] * len(q) + [0] * (width - len(q)) for q in seqs], dtype=torch.long)

    def aligned(rows: Sequence[Sequence[float]]) -> torch.Tensor:
        # Position t predicts token t+1: response token j sits at p+j and is predicted at p+j-1.
        out = []
        for i, (s, r) in enumerate(zip(samples, rows)):
            if len(r) != len(s.response_ids):
                raise ValueError(f"sample {i}: {len(r)} per-token values for its {len(s.response_ids)} response tokens")
            lead = len(s.prompt_ids) - 1 if len(r) else width - 1
            out.append([0.0] * lead + list(r) + [0.0] * (width - 1 - lead - len(r)))
        return torch.tensor(out, dtype=torch.float32).view(len(samples), width - 1)

    action = aligned([s.action_mask for s in samples])
    resp = aligned([[1.0] * len(s.response_ids) for s in samples])
    mask = aligned(train_masks if train_masks is not None else [s.action_mask for s in samples])
    tok = {k: aligned(rows) for k, rows in per_token.items()}
    packed = None
    if pack:
        units = prompt_units(samples) if share else []
        shared = sum(len(pr) for pr, _ in units) + sum(len(x.response_ids) for x in samples)
        if units and shared <= (1.0 - PACK_MIN_SAVING) * sum(map(len, seqs)):
            packed = pack_shared(samples, units, width, pad_id)
        else:
            packed = pack_rows(seqs, width, pad_id)
    if packed is not None and packed.input_ids.numel() > (1.0 - PACK_MIN_SAVING) * ids.numel():
        packed = None  # little padding to save: rows of sequences would only add attention work
    return MicroBatch(ids, att, ids[:, 1:], mask, action, resp, tok, packed)


def token_bins(lengths: Sequence[int], ids: Sequence[int], budget: int, packed: bool) -> list[list[int]]:
    """``ids`` cut into bins of at most ``budget`` tokens, first fit, longest first. A bin costs the sum of its
    lengths when packed, its rows × its longest when padded; a sequence over the budget is a bin alone."""
    bins: list[list[int]] = []
    cost: list[tuple[int, int]] = []  # (tokens, longest) per bin
    for n, i in sorted(zip(lengths, ids), key=lambda t: -t[0]):
        for b, (tok, top) in enumerate(cost):
            if (tok + n if packed else (len(bins[b]) + 1) * max(top, n)) <= budget:
                bins[b].append(i)
                cost[b] = (tok + n, max(top, n))
                break
        else:
            bins.append([i])
            cost.append((n, n))
    return bins
