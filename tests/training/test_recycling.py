"""Save points written over a spare one (RecyclingWrites for DeepSpeed's files, RecyclingSafetensors for the
weights) and the prune that keeps that spare."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.serialization import config

from rlpipe.storage.weights import file_weights_digest
from rlpipe.training.checkpoint import RecyclingWrites


class _Torch:  # the part of DeepSpeed's TorchCheckpointEngine the wrapper uses
    zipfile_serialization = True

    def load(self, path, map_location=None):
        return torch.load(path, map_location=map_location, weights_only=False)


def _state(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"optimizer": {"exp_avg": torch.randn(n, generator=g), "exp_avg_sq": torch.rand(n, generator=g)}, "step": seed}


def _same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and all(torch.equal(a["optimizer"][k], b["optimizer"][k]) for k in a["optimizer"])


def test_a_save_takes_the_spare_files_place_and_writes_over_it(tmp_path):
    w = RecyclingWrites(_Torch())
    spare, new = tmp_path / "spare", tmp_path / "iter=2"
    (spare / "deepspeed" / "state").mkdir(parents=True)
    (new / "deepspeed" / "state").mkdir(parents=True)
    rel = "deepspeed/state/mp_rank_00_model_states.pt"
    w.recycle(spare, None).save(_state(50_000, 1), str(spare / rel))  # the older save point, written fresh
    inode = os.stat(spare / rel).st_ino
    w.recycle(new, spare).save(_state(50_000, 2), str(new / rel))
    assert not (spare / rel).exists() and os.stat(new / rel).st_ino == inode  # the spare's file, written over
    assert _same(w.load(str(new / rel)), _state(50_000, 2))
    assert w.load.__self__ is w.inner  # all but save is the wrapped engine's


def test_a_smaller_state_over_a_larger_file_is_cut_to_its_size(tmp_path):
    w = RecyclingWrites(_Torch())
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    w.recycle(tmp_path / "a", None).save(_state(80_000, 1), str(tmp_path / "a" / "s.pt"))
    w.recycle(tmp_path / "b", tmp_path / "a").save(_state(1_000, 2), str(tmp_path / "b" / "s.pt"))
    plain = io.BytesIO()
    with config.patch({"save.compute_crc32": False}):
        torch.save(_state(1_000, 2), plain)
    assert (tmp_path / "b" / "s.pt").read_bytes() == plain.getvalue()  # torch.save's bytes, nothing after them


def test_a_save_leaves_out_the_zip_crc_and_loads_the_same(tmp_path):
    w = RecyclingWrites(_Torch())
    (tmp_path / "a").mkdir()
    path = tmp_path / "a" / "s.pt"
    w.recycle(tmp_path / "a", None).save(_state(5_000, 4), str(path))
    with zipfile.ZipFile(path) as z:
        data = [i for i in z.infolist() if i.filename.split("/")[-2] == "data"]
        assert data and all(i.CRC == 0 for i in data)  # the tensors' entries: no checksum computed
    assert _same(w.load(str(path)), _state(5_000, 4))
    assert config.save.compute_crc32  # put back: every other torch.save in the process computes it


def test_torch_load_does_not_check_the_zip_crc(tmp_path):
    """Why leaving the CRC out loses nothing: torch.load reads a file changed after its CRC was taken, silently.
    If a torch release starts checking it, this fails, and the save should compute it again."""
    path = tmp_path / "s.pt"
    torch.save({"x": torch.zeros(1000)}, path)
    raw = bytearray(path.read_bytes())
    raw[raw.find(bytes(64)) + 100] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert torch.load(path)["x"].abs().sum() > 0


def test_without_a_spare_the_file_is_new(tmp_path):
    w = RecyclingWrites(_Torch())
    (tmp_path / "a").mkdir()
    w.recycle(tmp_path / "a", tmp_path / "missing").save(_state(10, 3), str(tmp_path / "a" / "s.pt"))
    assert _same(torch.load(tmp_path / "a" / "s.pt", weights_only=False), _state(10, 3))


def test_the_trainer_writes_its_optimizer_over_the_spare_and_resumes_the_same(tiny_checkpoint, tmp_path, monkeypatch):
    import rlpipe.training.checkpoint as ck
    from tests.helpers.dist_update import fixed_batch
    from tests.training.test_trainer import _grpo_trainer

    torch.set_num_threads(1)
    a = _grpo_trainer(tiny_checkpoint)
    assert isinstance(a.engine.checkpoint_engine, RecyclingWrites)
    rel = "deepspeed/state/mp_rank_00_model_states.pt"
    a.update(fixed_batch(16), 0)
    a.save(tmp_path / "iter=0")
    inodes = [os.stat(tmp_path / "iter=0" / f).st_ino for f in (rel, "model.safetensors")]
    batch = fixed_batch(32)[16:]
    a.update(batch, 1)
    reads = []
    monkeypatch.setattr(ck, "_mapped_files", lambda real=ck._mapped_files: reads.append(1) or real())
    digest = a.save(tmp_path / "iter=1", spare=tmp_path / "iter=0")
    assert len(reads) == 1  # the process's maps read once for the save's two files (~7 ms a read in the RL loop)
    assert [os.stat(tmp_path / "iter=1" / f).st_ino for f in (rel, "model.safetensors")] == inodes  # both written over
    assert digest == file_weights_digest(tmp_path / "iter=1")
    after = fixed_batch(48)[32:]
    m = a.update(after, 2)
    b = _grpo_trainer(tiny_checkpoint, resume_dir=tmp_path / "iter=1")
    mb = b.update(after, 2)
    assert m["loss"] == pytest.approx(mb["loss"], rel=1e-6, abs=1e-9)
    for (name, pa_), (_, pb) in zip(a.module.named_parameters(), b.module.named_parameters()):
        assert torch.equal(pa_, pb), name


def test_the_prune_keeps_the_save_point_and_one_spare(tmp_path, monkeypatch):
    from rlpipe.runs import RunFolder

    root = tmp_path / "r" / "state"
    for k in (3, 9, 10, 11):
        (root / f"iter={k}").mkdir(parents=True)
        (root / f"iter={k}" / "f").write_text(str(k))
    (root / "spare").mkdir()
    RunFolder(tmp_path / "r").prune_states(keep=str(root / "iter=11"))
    assert sorted(p.name for p in root.iterdir()) == ["iter=11", "spare"]
    assert (root / "spare" / "f").read_text() == "10"  # the newest save point that is no longer needed
    RunFolder(tmp_path / "r").prune_states(keep=str(root / "iter=11"))  # nothing else left: the spare stays
    assert (root / "spare" / "f").read_text() == "10"


def test_a_prune_that_cannot_make_a_spare_still_deletes_the_old_points(tmp_path, monkeypatch):
    from rlpipe.runs import RunFolder

    root = tmp_path / "r" / "state"
    for k in (1, 2):
        (root / f"iter={k}").mkdir(parents=True)

    def refuse(src, dst):
        raise OSError("the spare is in the way")

    monkeypatch.setattr(os, "replace", refuse)
    RunFolder(tmp_path / "r").prune_states(keep=str(root / "iter=2"))
    assert sorted(p.name for p in root.iterdir()) == ["iter=2"]


def _tensors(seed: int, n: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"b.weight": torch.randn(n, 8, generator=g), "a.bias": torch.randn(8, generator=g).to(torch.bfloat16),
            "c.steps": torch.arange(3, dtype=torch.int64), "d.empty": torch.zeros(0)}


def test_safetensors_written_over_the_spare_read_back_the_same(tmp_path):
    from safetensors import safe_open
    from rlpipe.training.checkpoint import RecyclingSafetensors

    spare, new = tmp_path / "spare", tmp_path / "iter=2"
    spare.mkdir(), new.mkdir()
    RecyclingSafetensors(spare, None).write(_tensors(1, 5_000), spare / "model.safetensors", {"format": "pt"})
    inode, big = os.stat(spare / "model.safetensors").st_ino, os.stat(spare / "model.safetensors").st_size
    w = RecyclingSafetensors(new, spare)
    w.write(_tensors(2, 100), new / "model.safetensors", {"format": "pt"})  # smaller than the file it takes over
    path = new / "model.safetensors"
    assert not (spare / "model.safetensors").exists() and os.stat(path).st_ino == inode
    assert os.stat(path).st_size < big  # cut to its size: nothing of the old file after it
    got, want = load_file(path), _tensors(2, 100)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_save_pretrained_through_it_loads_the_same_model_and_hashes_the_file(tiny_checkpoint, tmp_path):
    import transformers.modeling_utils as mu
    from transformers import AutoModelForCausalLM

    from rlpipe.training.checkpoint import RecyclingSafetensors

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    original = mu.safe_save_file
    model.save_pretrained(tmp_path / "old", safe_serialization=True)
    inode = os.stat(tmp_path / "old" / "model.safetensors").st_ino
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    with RecyclingSafetensors(tmp_path / "new", tmp_path / "old"):
        model.save_pretrained(tmp_path / "new", safe_serialization=True)
    assert mu.safe_save_file is original  # put back
    assert os.stat(tmp_path / "new" / "model.safetensors").st_ino == inode
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "new")
    for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name


def test_another_threads_save_is_not_recycled(tmp_path):
    import threading

    import transformers.modeling_utils as mu

    from rlpipe.training.checkpoint import RecyclingSafetensors

    (tmp_path / "spare").mkdir(), (tmp_path / "mine").mkdir(), (tmp_path / "theirs").mkdir()
    RecyclingSafetensors(tmp_path / "spare", None).write(_tensors(1, 10), tmp_path / "spare" / "model.safetensors", None)
    with RecyclingSafetensors(tmp_path / "theirs", tmp_path / "spare"):
        t = threading.Thread(target=mu.safe_save_file, args=(_tensors(3, 10), str(tmp_path / "theirs" / "model.safetensors")))
        t.start(), t.join()
    assert (tmp_path / "spare" / "model.safetensors").exists()  # not taken by the other thread's file
    got = load_file(tmp_path / "theirs" / "model.safetensors")  # written by transformers' own writer, whole
    assert all(torch.equal(got[k], v) for k, v in _tensors(3, 10).items()) and len(got) == len(_tensors(3, 10))


def test_an_error_inside_puts_the_writer_back(tmp_path):
    import transformers.modeling_utils as mu

    from rlpipe.training.checkpoint import RecyclingSafetensors

    original = mu.safe_save_file
    with pytest.raises(RuntimeError, match="boom"), RecyclingSafetensors(tmp_path, None):
        raise RuntimeError("boom")
    assert mu.safe_save_file is original


def test_a_dtype_it_does_not_map_goes_to_the_original_writer(tmp_path):
    import transformers.modeling_utils as mu

    from rlpipe.training.checkpoint import RecyclingSafetensors

    odd = {"w": torch.zeros(4, dtype=torch.complex64)}  # a dtype this writer does not map
    handed: list[str] = []
    original = mu.safe_save_file
    mu.safe_save_file = lambda tensors, filename, metadata=None: handed.append(Path(filename).name)
    try:
        with RecyclingSafetensors(tmp_path, None):
            mu.safe_save_file(_tensors(1, 10), str(tmp_path / "model-00001.safetensors"))
            mu.safe_save_file(odd, str(tmp_path / "model-00002.safetensors"))
    finally:
        mu.safe_save_file = original
    assert handed == ["model-00002.safetensors"]  # the odd file to transformers' writer, the other written here
    got = load_file(tmp_path / "model-00001.safetensors")
    assert all(torch.equal(got[k], v) for k, v in _tensors(1, 10).items())


def test_a_spare_that_a_loaded_model_maps_is_not_written_over(tiny_checkpoint, tmp_path):
    """from_pretrained maps its safetensors copy-on-write: a model built from a save point (a resumed trainer)
    would see its weights change if that point, once the spare, were written over in place."""
    import shutil

    from transformers import AutoModelForCausalLM

    from rlpipe.training.checkpoint import RecyclingSafetensors

    shutil.copytree(tiny_checkpoint, tmp_path / "spare")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "spare")  # maps spare/model.safetensors
    before = {k: v.clone() for k, v in loaded.state_dict().items()}
    other = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    with RecyclingSafetensors(tmp_path / "new", tmp_path / "spare"):
        other.save_pretrained(tmp_path / "new", safe_serialization=True)
    assert (tmp_path / "spare" / "model.safetensors").exists()  # left in place: a new file was written instead
    assert all(torch.equal(before[k], v) for k, v in loaded.state_dict().items())
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "new")  # the new file holds the other model's weights
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), back.state_dict().values()))


def test_a_spare_file_with_another_name_is_not_written_over(tmp_path):
    """A local store links a save point's files (no second copy): once that point is the spare, a save that wrote
    over its files in place would change the store's copy. Such a file is left; the save writes a new one."""
    from rlpipe.storage import open_store

    w = RecyclingWrites(_Torch())
    spare, new = tmp_path / "spare", tmp_path / "iter=2"
    (spare / "deepspeed").mkdir(parents=True)
    (new / "deepspeed").mkdir(parents=True)
    rel = "deepspeed/optim.pt"
    w.recycle(spare, None).save(_state(50_000, 1), str(spare / rel))
    store = open_store(str(tmp_path / "store"))
    store.upload_dir(spare, "runs/r/checkpoints/iter=1", link=True)
    stored = store.path(f"runs/r/checkpoints/iter=1/{rel}")
    w.recycle(new, spare).save(_state(50_000, 2), str(new / rel))
    assert (spare / rel).exists() and os.stat(new / rel).st_ino != os.stat(stored).st_ino
    assert _same(w.load(stored), _state(50_000, 1)) and _same(w.load(str(new / rel)), _state(50_000, 2))


# ---- written past the page cache: PageBuffer and write_file ----


def _resident_bytes(path: Path) -> int:
    """How many of the file's bytes sit in the page cache (util-linux fincore)."""
    import shutil
    import subprocess

    if not shutil.which("fincore"):
        pytest.skip("fincore (util-linux) is not installed")
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def test_a_page_buffer_grows_keeping_its_bytes_and_torch_loads_what_it_holds():
    from rlpipe.training.checkpoint import PageBuffer

    buf = PageBuffer()
    buf.write(b"x" * 100)
    big = {"t": torch.arange(600_000, dtype=torch.float32)}  # 2.4 MB: past the first 1 MiB
    torch.save(big, buf.reset())
    assert torch.equal(torch.load(io.BytesIO(bytes(buf.padded()[:buf.size])))["t"], big["t"])
    assert len(buf.padded()) % 4096 == 0 and len(buf.padded()) - buf.size < 4096
    buf.reset().write(b"abc")
    buf.write(memoryview(b"defg"))
    assert buf.size == 7 and bytes(buf.padded()[:7]) == b"abcdefg"


def test_write_file_writes_the_exact_bytes_past_the_page_cache_over_a_longer_file(tmp_path):
    from rlpipe.training.checkpoint import PageBuffer, write_file

    data = os.urandom(3 * 1024 * 1024 + 123)  # not a whole number of pages or blocks
    path = tmp_path / "f.bin"
    path.write_bytes(b"\xff" * (len(data) + 50_000))  # longer: must be cut to the new size
    buf = PageBuffer()
    buf.write(data)
    write_file(path, buf)
    assert _resident_bytes(path) == 0  # O_DIRECT: nothing went through the page cache ...
    assert path.read_bytes() == data  # ... and the bytes and size are the buffer's
    plain = tmp_path / "plain.bin"
    plain.write_bytes(data)
    assert _resident_bytes(plain) > 0  # what a write through the page cache leaves (the check can fail)


def test_write_file_falls_back_to_a_plain_write_where_o_direct_is_refused(tmp_path, monkeypatch):
    import errno

    from rlpipe.training import checkpoint
    from rlpipe.training.checkpoint import PageBuffer, write_file

    real_open, tried = os.open, []

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            tried.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(checkpoint.os, "open", no_direct)
    buf = PageBuffer()
    buf.write(b"hello, page cache")
    write_file(tmp_path / "f", buf)
    assert tried and (tmp_path / "f").read_bytes() == b"hello, page cache"


def test_rlpipe_save_direct_io_0_writes_through_the_page_cache(tmp_path, monkeypatch):
    from rlpipe.training.checkpoint import PageBuffer, write_file

    monkeypatch.setenv("RLPIPE_SAVE_DIRECT_IO", "0")
    buf = PageBuffer()
    buf.write(os.urandom(1 << 20))
    write_file(tmp_path / "f", buf)
    assert _resident_bytes(tmp_path / "f") == 1 << 20


def test_exported_weights_go_through_the_kept_buffer_and_load_the_same(tmp_path):
    from rlpipe.training.checkpoint import PageBuffer, RecyclingSafetensors

    g = torch.Generator().manual_seed(3)
    tensors = {"b.weight": torch.randn(300, 700, generator=g), "a.bias": torch.randn(7, generator=g),
               "c.half": torch.randn(5, 3, generator=g).to(torch.bfloat16), "d.empty": torch.zeros(0)}
    buf = PageBuffer()
    for k in range(2):  # the second export reuses the buffer
        RecyclingSafetensors(tmp_path, None, buf).write(tensors, tmp_path / f"m{k}.safetensors", {"format": "pt"})
        assert _resident_bytes(tmp_path / f"m{k}.safetensors") == 0  # before it is read back
        back = load_file(tmp_path / f"m{k}.safetensors")
        assert set(back) == set(tensors) and all(torch.equal(back[n], tensors[n]) for n in tensors)
