import json
import os

import pytest

from rlpipe.storage.atomic import copy_atomic, link_atomic, write_atomic, write_json_atomic


def test_write_atomic_replaces_whole_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "a" / "b.json"
    write_json_atomic(p, {"b": 1, "a": [1, 2]})
    write_atomic(p, "second")
    assert p.read_text() == "second"
    assert os.listdir(p.parent) == ["b.json"]


def test_write_atomic_failure_keeps_the_old_file(tmp_path, monkeypatch):
    p = tmp_path / "x.json"
    write_json_atomic(p, {"v": 1})

    def broken(*_a, **_k):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk gone"):
        write_atomic(p, b"new")
    assert json.loads(p.read_text()) == {"v": 1}
    assert os.listdir(tmp_path) == ["x.json"]


def test_copy_atomic_copies_whole_and_a_failure_keeps_the_old_file(tmp_path, monkeypatch):
    src, p = tmp_path / "src.bin", tmp_path / "out" / "w.bin"
    src.write_bytes(os.urandom(3 << 20))
    write_atomic(p, b"old")
    copy_atomic(src, p)
    assert p.read_bytes() == src.read_bytes() and os.listdir(p.parent) == ["w.bin"]
    monkeypatch.setattr(os, "replace", lambda *_a, **_k: (_ for _ in ()).throw(OSError("disk gone")))
    src.write_bytes(b"new")
    with pytest.raises(OSError, match="disk gone"):
        copy_atomic(src, p)
    assert len(p.read_bytes()) == 3 << 20 and os.listdir(p.parent) == ["w.bin"]  # the old file, no temporary


def test_link_atomic_names_the_same_file_and_says_when_it_cannot(tmp_path, monkeypatch):
    src, p = tmp_path / "state.pt", tmp_path / "store" / "state.pt"
    src.write_bytes(b"optimizer")
    write_atomic(p, b"old")
    assert link_atomic(src, p)
    assert os.stat(p).st_ino == os.stat(src).st_ino and os.stat(src).st_nlink == 2  # one file, two names
    assert os.listdir(p.parent) == ["state.pt"]
    monkeypatch.setattr(os, "link", lambda *_a, **_k: (_ for _ in ()).throw(OSError(18, "Invalid cross-device link")))
    q = tmp_path / "other" / "state.pt"
    assert not link_atomic(src, q)  # the caller copies instead
    assert not q.exists() and os.listdir(q.parent) == []
