"""Weight hashing and the one safetensors folder loader: the floor that trainer, engines and resume stand on.

The weight hash identifies a policy version everywhere (trajectory rows, the registry, the sync check with the
generation workers, a resume's check of its save point). It is computed from tensors, not files, so the same
weights hash the same whether they sit in a trainer, in a safetensors file or in vLLM.

Imports torch (the hash reads tensor buffers); ``rlpipe.storage`` itself does not import this module, so the
object store stays light.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import torch

__all__ = ["file_weights_sha256", "load_safetensors_folder", "weights_sha256"]


def weights_sha256(named_tensors: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, in name order.

    The policy version is this hash of the saved safetensors (see :func:`file_weights_sha256`):
    HF drops tied copies on save, so hash what was saved, not a live ``state_dict()``.
    """
    items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
    h = hashlib.sha256()
    for name, t in sorted(items, key=lambda kv: kv[0]):
        t = t.detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy() if t.numel() else b"")  # the tensor's buffer, not a copy of it
    return h.hexdigest()


def load_safetensors_folder(folder: str | Path, pattern: str = "*.safetensors") -> dict[str, torch.Tensor]:
    """Every tensor of the folder's files matching ``pattern`` (files in name order, as one dict, on the CPU);
    ``{}`` when there are none: the caller says what is missing, in its own error type."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob(pattern)):
        tensors.update(load_file(f))
    return tensors


def file_weights_sha256(folder: str | Path) -> str:
    """:func:`weights_sha256` of a folder's ``*.safetensors`` weights; FileNotFoundError where it holds none."""
    tensors = load_safetensors_folder(folder)
    if not tensors:
        raise FileNotFoundError(f"{folder} holds no *.safetensors weights")
    return weights_sha256(tensors)
