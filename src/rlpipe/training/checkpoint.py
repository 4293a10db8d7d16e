"""Checkpoints: HF-format weights (safetensors) + tokenizer + trainer state, and the writers that recycle a spare
save point's files.

The weight hash (the policy version) comes from :mod:`rlpipe.storage.weights`; a save returns the hash of what it wrote.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import random
import threading
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlpipe.storage.weights import file_weights_digest
from rlpipe.tokens import load_tokenizer

TRAINER_STATE = "trainer_state.json"
ADAPTER = "adapter"  # a LoRA save point's adapter folder (peft's adapter_config.json + adapter_model.safetensors)

__all__ = ["ADAPTER", "TRAINER_STATE", "PageBuffer", "RecyclingSafetensors", "RecyclingWrites", "Spare", "load_checkpoint",
           "read_trainer_state", "rng_state", "save_checkpoint", "set_rng_state", "write_file"]


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    folder: str | Path,
    model: Any,
    tokenizer: Any,
    trainer_state: dict[str, Any] | None = None,
) -> str:
    """Write weights, tokenizer and trainer state; returns the weights' digest of what was written.

    (The RL trainer's optimizer state is DeepSpeed's: see ``PolicyTrainer.save``.)"""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    digest = file_weights_digest(folder)
    state = dict(trainer_state or {})
    state["weights_sha256"] = digest
    (folder / TRAINER_STATE).write_text(json.dumps(state, indent=2, sort_keys=True, default=str))
    return digest


def hf_checkpoint_tensors(model: Any, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """What ``model.save_pretrained(state_dict=state_dict)`` writes, in memory and without a copy: the keys it
    ignores left out, tied copies dropped (the name it keeps), weight conversions reverted, by transformers' own
    functions. The weights the trainer hands an engine and hashes, equal to the saved file's (tested on two
    architectures and under LoRA)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict, revert_weight_conversion

    sd = dict(model.state_dict() if state_dict is None else state_dict)
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        sd.pop(key, None)
    sd = revert_weight_conversion(model, remove_tied_weights_from_state_dict(sd, model))
    return {k: v.detach() for k, v in sd.items()}


def load_checkpoint(folder: str | Path, dtype: torch.dtype = torch.float32) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, trainer_state) from a checkpoint folder or any HF causal-LM folder."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder} is not an HF model folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    tokenizer = load_tokenizer(folder)
    return model, tokenizer, read_trainer_state(folder, missing_ok=True)


def read_trainer_state(folder: str | Path, missing_ok: bool = False) -> dict[str, Any]:
    """A checkpoint's trainer state (``trainer_state.json``: iteration, RNG, KL controller, …); ``{}`` for a
    plain HF folder when ``missing_ok``."""
    path = Path(folder) / TRAINER_STATE
    if missing_ok and not path.exists():
        return {}
    return json.loads(path.read_text())


class RecyclingWrites:
    """A DeepSpeed checkpoint engine (wrapping its torch one) that writes each file over a spare one.

    A save point's optimizer state is the same size every iteration. Written as a new file, it takes new
    page-cache pages; on a VM that hands freed memory back to its host (free page reporting) the first touch of
    such pages runs at ~140 MB/s (~28 µs per 4 KiB page), and the demo's 27.6 MB save took 16 ms or 150–210 ms at random (measured in
    the loop, benchmarks/history.md). Serialised into a buffer kept from the last save and written over the file
    of the same name in a save point that is no longer needed (``spare``, moved into place first), it took
    14–22 ms in 19 of 20 saves (the first fills the buffer). The bytes written are torch.save's, as before; without a spare the file is new.
    The buffer is page-aligned, so the file is written past the page cache (:func:`write_file`).
    """

    def __init__(self, inner: Any):
        self.inner = inner
        self.buffer = PageBuffer()
        self.folder: Path | None = None
        self.spare: Spare | None = None

    def __getattr__(self, name: str) -> Any:  # everything but save is the wrapped engine's
        return getattr(self.inner, name)

    def recycle(self, folder: Path, spare: Spare | Path | None) -> "RecyclingWrites":
        """Saves below ``folder`` may take their file's place from the same relative path below ``spare``."""
        self.folder, self.spare = Path(folder), Spare.of(spare)
        return self

    def save(self, state_dict: dict[str, Any], path: str) -> None:
        with _without_zip_crc():
            torch.save(state_dict, self.buffer.reset(), _use_new_zipfile_serialization=self.inner.zipfile_serialization)
        if self.spare is not None and self.folder is not None:
            self.spare.take(Path(path).relative_to(self.folder), Path(path))
        write_file(Path(path), self.buffer)


@contextmanager
def _without_zip_crc():
    """torch.save without the CRC-32 of each zip entry: torch.load never checks it (a flipped byte loads silently,
    tests/training/test_recycling.py), and computing it cost 0.3 s of CPU per 454 MB, 0.6 s of a save
    point's AdamW moments at 113M, taken from the generation and sync it runs beside. The file is the same zip
    otherwise: torch.load and DeepSpeed read it as before."""
    from torch.utils.serialization import config

    with config.patch({"save.compute_crc32": False}):
        yield


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def _safetensors_header(tensors: dict[str, torch.Tensor],
                        metadata: dict[str, str] | None) -> tuple[bytes, list[tuple[str, int]], int]:
    """The safetensors header (little-endian length + JSON, padded to 8 bytes), each tensor's data offset, and
    the data's size."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offsets, at = [], 0
    for name in sorted(tensors):
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + size]}
        offsets.append((name, at))
        at += size
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body, offsets, at


def _mapped_files() -> set[tuple[int, int, int]] | None:
    """(major, minor, inode) of every file this process maps; None where ``/proc/self/maps`` cannot be read."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    out = set()
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) >= 5 and parts[4] != "0":
            major, _, minor = parts[3].partition(":")
            out.add((int(major, 16), int(minor, 16), int(parts[4])))
    return out


class Spare:
    """An earlier save point no longer needed, whose files one save writes over (their inodes and pages reused).

    A file of it is taken only where it has no other name (a local store links a save point's files rather than
    copying them) and where this process does not map it: transformers' ``from_pretrained`` maps the
    safetensors it loads (copy-on-write), and a trainer or engine built from that save point would see its
    weights change under it where it has not written them yet. Then, or where ``/proc/self/maps`` cannot be
    read, the write goes to a new file. The maps are read once, at the first file taken: in the RL loop's process
    (torch, vLLM) a read costs ~7 ms, and one save takes two or three files."""

    def __init__(self, folder: Path | str):
        self.folder = Path(folder)

    @classmethod
    def of(cls, spare: "Spare | Path | str | None") -> "Spare | None":
        return spare if isinstance(spare, Spare) or spare is None else cls(spare)

    def take(self, relative: Path, path: Path) -> None:
        """Move the spare's file at ``relative`` to ``path``, to be written over, unless it is mapped here."""
        old = self.folder / relative
        if not old.is_file():
            return
        st = old.stat()
        if st.st_nlink > 1:  # another name holds it too (a local store's copy of the save point): never written over
            return
        if self._mapped is None or (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in self._mapped:
            return
        os.replace(old, path)

    @cached_property
    def _mapped(self) -> set[tuple[int, int, int]] | None:
        """(device major, minor, inode) of each file this process maps, read at the first file taken."""
        return _mapped_files()


class PageBuffer:
    """A growable, page-aligned buffer in anonymous memory that ``torch.save`` (a file-like ``write``) and the
    safetensors writer fill, kept from one save to the next: its pages are touched once, by the first save."""

    def __init__(self) -> None:
        self._map: mmap.mmap | None = None
        self.size = 0

    def reset(self) -> "PageBuffer":
        self.size = 0
        return self

    def reserve(self, n: int) -> memoryview:
        """Room for ``n`` bytes in all (what was written is kept); the whole buffer's view."""
        have = len(self._map) if self._map is not None else 0
        if n > have:
            want = max(n, 2 * have, 1 << 20)
            grown = mmap.mmap(-1, want + (-want) % mmap.PAGESIZE)
            if self._map is not None:
                grown[:self.size] = self._map[:self.size]
                self._map.close()
            self._map = grown
        return memoryview(self._map)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        self.reserve(self.size + n)[self.size:self.size + n] = view
        self.size += n
        return n

    def flush(self) -> None:
        pass

    def padded(self) -> memoryview:
        """The bytes written, padded with what follows them up to a whole page (the buffer's own memory)."""
        end = self.size + (-self.size) % mmap.PAGESIZE
        return self.reserve(end)[:end]


def write_file(path: Path, buffer: PageBuffer) -> None:
    """The buffer's bytes as the file ``path`` (over it, where it exists), written with ``O_DIRECT``: straight from
    the buffer to the disk, past the page cache. A save point's 1.36 GB at 113M took 1.2–2.9 s of CPU through the
    page cache on this VM, each new page's first touch included, and 0.02 s direct (1 GiB: 0.43 s;
    benchmarks/README.md). Where the file system refuses ``O_DIRECT`` (tmpfs) the file is written as before, and so
    everywhere with ``RLPIPE_SAVE_DIRECT_IO=0``: a write then ends once the bytes are in the page cache, which is
    sooner where the disk is slow (a network volume at ~250 MB/s takes 5 s for 1.36 GB) and CPU is plentiful."""
    direct = getattr(os, "O_DIRECT", 0) if os.environ.get("RLPIPE_SAVE_DIRECT_IO", "1") != "0" else 0
    if direct:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | direct, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        else:
            try:
                _pwrite_all(fd, buffer.padded(), 0)  # whole pages from page-aligned memory: what O_DIRECT asks
                os.ftruncate(fd, buffer.size)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
            finally:
                os.close(fd)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        _pwrite_all(fd, buffer.padded()[:buffer.size], 0)
        os.ftruncate(fd, buffer.size)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class RecyclingSafetensors:
    """transformers' ``save_pretrained`` with its safetensors files written over a spare save point's.

    The same reason as :class:`RecyclingWrites`: a new file takes new page-cache pages, and on this VM their first
    touch is slow. The weights are the larger part of a save point (exporting the 33.6M model's 134 MB took
    0.32–0.44 s into a new file, 0.095–0.099 s over the spare's; benchmarks/history.md). Each file is written
    straight from the tensors it is handed (a valid safetensors file that any reader loads; the tensors in name
    order); a dtype it does not map goes to transformers' own writer. With a ``buffer`` (a save point's, kept by the
    trainer) the file is assembled there and written past the page cache (:func:`write_file`); without, it is
    written from the tensors themselves. The weights' hash is the trainer's, taken
    once from the tensors handed over (``PolicyTrainer.policy_tensors``); a resume hashes the state's file.

    A context manager around one ``save_pretrained`` call of this thread; other threads' saves are untouched.
    """

    def __init__(self, folder: Path, spare: Spare | Path | None, buffer: PageBuffer | None = None):
        self.folder, self.spare, self.buffer = Path(folder), Spare.of(spare), buffer
        self._thread: int | None = None
        self._original: Any = None

    def __enter__(self) -> "RecyclingSafetensors":
        import transformers.modeling_utils as mu

        self._thread, self._original = threading.get_ident(), mu.safe_save_file
        original = self._original

        def save_file(tensors: dict[str, torch.Tensor], filename: str, metadata: dict[str, str] | None = None) -> None:
            if threading.get_ident() != self._thread:
                return original(tensors, filename, metadata=metadata)
            if any(t.dtype not in _SAFETENSORS_DTYPES for t in tensors.values()):  # a dtype it does not map
                return original(tensors, filename, metadata=metadata)
            self.write(tensors, Path(filename), metadata)

        mu.safe_save_file = save_file
        return self

    def __exit__(self, *exc: object) -> None:
        import transformers.modeling_utils as mu

        mu.safe_save_file = self._original

    def write(self, tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None) -> None:
        cpu = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
        header, offsets, size = _safetensors_header(cpu, metadata)
        if self.spare is not None and path.is_relative_to(self.folder):
            self.spare.take(path.relative_to(self.folder), path)
        if self.buffer is not None:  # copied into the kept page-aligned buffer, and written from it past the page cache
            self.buffer.reset().write(header)
            view = self.buffer.reserve(len(header) + size)
            for name, at in offsets:
                if cpu[name].numel():
                    data = cpu[name].reshape(-1).view(torch.uint8).numpy()
                    view[len(header) + at:len(header) + at + len(data)] = data
            self.buffer.size = len(header) + size
            write_file(path, self.buffer)
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            _pwrite_all(fd, memoryview(header), 0)
            for name, at in offsets:
                if cpu[name].numel():
                    _pwrite_all(fd, memoryview(cpu[name].reshape(-1).view(torch.uint8).numpy()), len(header) + at)
            os.ftruncate(fd, len(header) + size)
        finally:
            os.close(fd)
