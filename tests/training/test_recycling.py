"""Save points written over a spare one (RecyclingWrites) and the prune that keeps that spare."""

from __future__ import annotations

import io
import os

import pytest
import torch

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
    torch.save(_state(1_000, 2), plain)
    assert (tmp_path / "b" / "s.pt").read_bytes() == plain.getvalue()  # torch.save's bytes, nothing after them


def test_without_a_spare_the_file_is_new(tmp_path):
    w = RecyclingWrites(_Torch())
    (tmp_path / "a").mkdir()
    w.recycle(tmp_path / "a", tmp_path / "missing").save(_state(10, 3), str(tmp_path / "a" / "s.pt"))
    assert _same(torch.load(tmp_path / "a" / "s.pt", weights_only=False), _state(10, 3))


def test_the_trainer_writes_its_optimizer_over_the_spare_and_resumes_the_same(tiny_checkpoint, tmp_path):
    from tests.helpers.dist_update import fixed_batch
    from tests.training.test_trainer import _grpo_trainer

    torch.set_num_threads(1)
    a = _grpo_trainer(tiny_checkpoint)
    assert isinstance(a.engine.checkpoint_engine, RecyclingWrites)
    rel = "deepspeed/state/mp_rank_00_model_states.pt"
    a.update(fixed_batch(16), 0)
    a.save(tmp_path / "iter=0")
    inode = os.stat(tmp_path / "iter=0" / rel).st_ino
    batch = fixed_batch(32)[16:]
    a.update(batch, 1)
    a.save(tmp_path / "iter=1", spare=tmp_path / "iter=0")
    assert os.stat(tmp_path / "iter=1" / rel).st_ino == inode
    after = fixed_batch(48)[32:]
    m = a.update(after, 2)
    b = _grpo_trainer(tiny_checkpoint, resume_dir=tmp_path / "iter=1")
    mb = b.update(after, 2)
    assert m["loss"] == pytest.approx(mb["loss"], rel=1e-6, abs=1e-9)
    for (name, pa_), (_, pb) in zip(a.module.named_parameters(), b.module.named_parameters()):
        assert torch.equal(pa_, pb), name


def test_the_prune_keeps_the_save_point_and_one_spare(tmp_path, monkeypatch):
    from flows import iteration as fi
    from tasks import rl

    monkeypatch.setattr(rl, "run_dir", lambda run_id: tmp_path / run_id)
    root = tmp_path / "r" / "state"
    for k in (3, 9, 10, 11):
        (root / f"iter={k}").mkdir(parents=True)
        (root / f"iter={k}" / "f").write_text(str(k))
    (root / "spare").mkdir()
    fi._prune_states("r", keep=str(root / "iter=11"))
    assert sorted(p.name for p in root.iterdir()) == ["iter=11", "spare"]
    assert (root / "spare" / "f").read_text() == "10"  # the newest save point that is no longer needed
    fi._prune_states("r", keep=str(root / "iter=11"))  # nothing else left: the spare stays
    assert (root / "spare" / "f").read_text() == "10"


def test_a_prune_that_cannot_make_a_spare_still_deletes_the_old_points(tmp_path, monkeypatch):
    from flows import iteration as fi
    from tasks import rl

    monkeypatch.setattr(rl, "run_dir", lambda run_id: tmp_path / run_id)
    root = tmp_path / "r" / "state"
    for k in (1, 2):
        (root / f"iter={k}").mkdir(parents=True)

    def refuse(src, dst):
        raise OSError("the spare is in the way")

    monkeypatch.setattr(os, "replace", refuse)
    fi._prune_states("r", keep=str(root / "iter=2"))
    assert sorted(p.name for p in root.iterdir()) == ["iter=2"]
