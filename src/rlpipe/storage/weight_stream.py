"""Weights on the wire: a name → tensor dict cut into buckets of safetensors bytes, and joined back.

The trainer's weights reach a rollout replica over HTTP in buckets (``RemoteEngine.load_tensors`` sends,
``rlpipe serve rollout`` receives; the trainer service serves its new weights the same way), not through an
object-store upload that every replica downloads again. It sits on the storage floor, beside the weight hash,
so that both the trainer and the rollout side use it.
A bucket holds whole tensors, in name order, up to ``bucket_bytes`` of tensor data; a tensor larger than that
gets a bucket of its own. Each bucket is a complete safetensors file in memory (``safetensors.torch.save``):
names, dtypes and shapes travel with the bytes, so a bucket decodes on its own and bf16 stays bf16.

The buckets carry no hash: the receiver hashes what it decoded (:func:`rlpipe.storage.weights.weights_sha256`)
and compares it with the sender's, which is the proof that the transfer was whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by the caller that has tensors; importing this module stays light
    import torch

__all__ = ["DEFAULT_BUCKET_BYTES", "bytes_bound", "decode_bucket", "decode_buckets", "encode_bucket", "encode_buckets",
           "join_buckets", "split_buckets"]

# 64 MiB: a few hundred ms per request on a local link, and a 7B bf16 model in ~230 requests.
DEFAULT_BUCKET_BYTES = 64 << 20


def split_buckets(tensors: Mapping[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[str]]:
    """The tensor names of each bucket, in name order: a bucket takes tensors until the next would bring its
    tensor data past ``bucket_bytes``; a tensor larger than that alone fills one."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes}: give a positive number of bytes per bucket")
    buckets: list[list[str]] = []
    size = 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if not buckets or size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += n
    return buckets


def encode_bucket(tensors: Mapping[str, torch.Tensor], names: list[str]) -> bytes:
    """The tensors ``names`` of ``tensors`` as one bucket of safetensors bytes (moved to the CPU, made contiguous;
    tensors sharing memory are copied apart, which safetensors requires)."""
    from safetensors.torch import save

    seen: set[int] = set()
    part = {}
    for name in names:
        t = tensors[name].detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        part[name] = t.clone() if ptr in seen and t.numel() else t
        seen.add(ptr)
    return save(part)


def encode_buckets(tensors: Mapping[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[bytes]:
    """Each bucket of :func:`split_buckets` as safetensors bytes (:func:`encode_bucket`)."""
    if not tensors:
        raise ValueError("no tensors to send")
    return [encode_bucket(tensors, names) for names in split_buckets(tensors, bucket_bytes)]


def bytes_bound(tensors: Mapping[str, torch.Tensor], buckets: list[list[str]]) -> int:
    """At least the bytes :func:`encode_bucket` makes of ``buckets`` in all, known before any is encoded (a
    stream declares its size up front and sends each bucket as soon as it is made): the tensor data, and per
    tensor its header entry ``"name":{"dtype":"BF16","shape":[…],"data_offsets":[a,b]},`` with every number
    at most 20 digits; per bucket the 8-byte header length, the braces and the padding to 8 bytes."""
    import json

    size = 32 * len(buckets)
    for names in buckets:
        for name in names:
            t = tensors[name]
            size += t.numel() * t.element_size() + len(json.dumps(name)) + 64 + 21 * (t.dim() + 2)
    return size


def decode_bucket(data: bytes | bytearray, k: int = 0) -> dict[str, torch.Tensor]:
    """Bucket ``k``'s tensors; ValueError when ``data`` is not safetensors bytes."""
    from safetensors.torch import load

    try:
        return load(bytes(data))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for bad bytes
        raise ValueError(f"bucket {k} is not safetensors bytes ({type(e).__name__}: {e})") from None


def join_buckets(parts: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Decoded buckets as one dict; ValueError when a name comes twice (buckets of different streams mixed up)."""
    out: dict[str, torch.Tensor] = {}
    for k, part in enumerate(parts):
        twice = sorted(set(part) & set(out))
        if twice:
            raise ValueError(f"bucket {k} repeats tensors of an earlier bucket: {twice[:3]}")
        out.update(part)
    return out


def decode_buckets(buckets: Iterable[bytes]) -> dict[str, torch.Tensor]:
    """The tensors of every bucket as one dict (:func:`decode_bucket`, then :func:`join_buckets`)."""
    return join_buckets(decode_bucket(data, k) for k, data in enumerate(buckets))
