import pyarrow as pa
import os

import pytest

from rlpipe.storage import PROMPT_SCHEMA, TRAJECTORY_SCHEMA, StageNotFound, open_store
from rlpipe.storage.layout import check_run_id, stage_prefix
from rlpipe.storage.store import MANIFEST, StageCorrupt


@pytest.fixture
def store(local_or_s3_store):
    return local_or_s3_store


def prompts(n, start=0):
    return pa.Table.from_pylist(
        [{"id": f"q{i}", "prompt": f"{i}+1=", "chat": False, "task": "math", "ground_truth": str(i + 1),
          "tests": None, "split": "train", "source": None} for i in range(start, start + n)],
        schema=PROMPT_SCHEMA,
    )


def trajectories(n):
    return pa.Table.from_pylist(
        [{"run_id": "r", "iteration": 0, "prompt_id": f"q{i}", "sample_index": i % 4, "policy_version": "ab" * 32,
          "prompt_token_ids": [1, 2, 3], "response_token_ids": [4, 5], "response_text": "45", "logprobs": [-0.5, -0.25],
          "loss_mask": [1, 1], "steps": None, "reward": 1.0 if i % 2 else None,
          "reward_status": "ok" if i % 2 else "timeout", "reward_reason": None, "verifier": "math",
          "verifier_version": "1", "truncated": False, "generate_s": 0.1, "verify_s": 0.01} for i in range(n)],
        schema=TRAJECTORY_SCHEMA,
    )


def test_stage_round_trip_keeps_schema_and_rows(store):
    prefix = stage_prefix("run-1", 0, "rollout")
    manifest = store.write_stage(prefix, [trajectories(3), trajectories(2)], meta={"k": 1}, schema=TRAJECTORY_SCHEMA)
    assert manifest["rows"] == 5 and [p["rows"] for p in manifest["parts"]] == [3, 2]
    got = store.read_stage(prefix, schema=TRAJECTORY_SCHEMA)
    assert got.num_rows == 5 and got.schema.equals(TRAJECTORY_SCHEMA, check_metadata=False)
    assert got.column("logprobs").to_pylist()[0] == [-0.5, -0.25]
    assert got.column("reward").to_pylist()[:2] == [None, 1.0]
    assert store.read_manifest(prefix)["meta"] == {"k": 1}


def test_crash_between_parts_and_manifest_leaves_no_stage(store, monkeypatch):
    prefix = "runs/r/iter=1/verify"
    store.write_stage(prefix, [prompts(3), prompts(3, 3), prompts(3, 6)], schema=PROMPT_SCHEMA)
    assert store.stage_done(prefix)

    def crash(key, obj):
        raise OSError("killed before the manifest")

    monkeypatch.setattr(store, "put_json", crash)
    with pytest.raises(OSError):
        store.write_stage(prefix, [prompts(1, 100)], schema=PROMPT_SCHEMA)
    monkeypatch.undo()
    # The half write is invisible: neither the new part nor the old complete stage is readable.
    assert not store.stage_done(prefix)
    with pytest.raises(StageNotFound):
        store.read_stage(prefix)
    # A retried writer overwrites cleanly: only its own parts are read.
    store.write_stage(prefix, [prompts(2, 50)], schema=PROMPT_SCHEMA)
    assert store.read_stage(prefix).column("id").to_pylist() == ["q50", "q51"]
    assert [k.rsplit("/", 1)[-1] for k in store.list(prefix)] == [MANIFEST, "part-00000.parquet"]


def test_stray_parts_without_a_manifest_entry_are_ignored(store):
    prefix = "runs/r/iter=2/rollout"
    store.write_stage(prefix, [prompts(2)], schema=PROMPT_SCHEMA)
    store.write_table(f"{prefix}/part-00007.parquet", prompts(5, 10))  # e.g. left by a dead writer
    assert store.read_stage(prefix).num_rows == 2


def test_tampered_part_is_detected(store):
    prefix = "runs/r/iter=3/rollout"
    store.write_stage(prefix, [prompts(2)], schema=PROMPT_SCHEMA)
    store.write_table(f"{prefix}/part-00000.parquet", prompts(2, 5))
    with pytest.raises(StageCorrupt, match="sha256"):
        store.read_stage(prefix)


def test_bad_table_names_the_column(store):
    bad = prompts(2).drop_columns(["task"])
    with pytest.raises(ValueError, match="required column 'task' is missing"):
        store.write_stage("runs/r/iter=4/x", [bad], schema=PROMPT_SCHEMA)


def test_folder_upload_download(store, tmp_path):
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / "model.safetensors").write_bytes(b"\x00\x01" * 1000)
    (src / "sub" / "state.json").write_text('{"a": 1}')
    store.upload_dir(src, "runs/r/checkpoints/sft")
    out = store.download_dir("runs/r/checkpoints/sft", tmp_path / "back")
    assert (out / "model.safetensors").read_bytes() == b"\x00\x01" * 1000
    assert (out / "sub" / "state.json").read_text() == '{"a": 1}'
    with pytest.raises(FileNotFoundError):
        store.download_dir("runs/nope", tmp_path / "x")


def test_a_file_larger_than_one_upload_part_goes_up_whole(store, tmp_path):
    """A save point's optimizer state is a gigabyte: uploaded from the file in parts (S3's multipart upload above
    its block size), never read whole into memory; it comes back byte for byte."""
    import hashlib

    src = tmp_path / "big"
    src.mkdir()
    data = os.urandom(70 << 20)  # above s3fs's 50 MiB block: a multipart upload
    (src / "optim.pt").write_bytes(data)
    store.upload_dir(src, "runs/r/checkpoints/iter=0")
    back = store.download_dir("runs/r/checkpoints/iter=0", tmp_path / "back")
    assert hashlib.sha256((back / "optim.pt").read_bytes()).digest() == hashlib.sha256(data).digest()


def test_a_linked_upload_names_the_local_file_in_a_local_store_and_copies_elsewhere(store, tmp_path, monkeypatch):
    """A save point's state goes into a local store by hard link (one write of it, not two); S3, or a local store
    on another file system, gets a copy; either way the same bytes come back."""
    src = tmp_path / "state"
    src.mkdir()
    (src / "optim.pt").write_bytes(b"moments" * 1000)
    store.upload_dir(src, "runs/r/checkpoints/iter=1", link=True)
    back = store.download_dir("runs/r/checkpoints/iter=1", tmp_path / "back")
    assert (back / "optim.pt").read_bytes() == b"moments" * 1000
    assert os.stat(src / "optim.pt").st_nlink == (2 if store.is_local else 1)
    if store.is_local:
        assert os.stat(store.path("runs/r/checkpoints/iter=1/optim.pt")).st_ino == os.stat(src / "optim.pt").st_ino
        monkeypatch.setattr(os, "link", lambda *_a, **_k: (_ for _ in ()).throw(OSError(18, "cross-device link")))
        store.upload_dir(src, "runs/r/checkpoints/iter=2", link=True)
        copied = store.path("runs/r/checkpoints/iter=2/optim.pt")
        assert os.stat(copied).st_ino != os.stat(src / "optim.pt").st_ino
        assert open(copied, "rb").read() == b"moments" * 1000


def test_keys_and_run_ids_cannot_escape(store):
    with pytest.raises(ValueError):
        store.path("../etc/passwd")
    with pytest.raises(ValueError):
        check_run_id("../x")


def test_s3_auth_is_enforced(s3_server, monkeypatch):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RLPIPE_S3_SECRET_ACCESS_KEY", "wrong")
    store = open_store(f"s3://{s3_server.bucket}/auth")
    with pytest.raises(Exception) as e:
        store.put_bytes("x", b"1")
    assert "denied" in str(e.value).lower() or "signature" in str(e.value).lower() or "forbidden" in str(e.value).lower()
