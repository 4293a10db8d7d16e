import json
import os

import pytest

from rlpipe.storage.atomic import write_atomic, write_json_atomic


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
