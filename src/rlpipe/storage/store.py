"""One object-store interface over a local folder (the embedded default) and any S3 endpoint.

Stages are the unit of exchange between pipeline steps: a stage is a folder of Parquet parts
plus ``_manifest.json`` written **last**. A reader trusts only the manifest, so it never sees a
half-written stage; a writer that is retried first removes the old manifest, then the old parts,
then writes everything anew, so a crash between parts and manifest leaves a stage that simply
does not exist yet (and stray parts that no manifest names are never read).

    store = open_store("s3://bucket/rlpipe")        # or a local path
    store.write_stage("runs/r1/iter=0/rollout", [table], meta={"rows": 64})
    table = store.read_stage("runs/r1/iter=0/rollout")
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
import pyarrow as pa
import pyarrow.parquet as pq

from rlpipe.config import Settings, settings as read_settings
from rlpipe.storage.atomic import copy_atomic, link_atomic, write_atomic
from rlpipe.storage.credentials import S3CredentialsError, resolve_s3_credentials

MANIFEST = "_manifest.json"

__all__ = ["MANIFEST", "ObjectStore", "S3CredentialsError", "StageNotFound", "StageCorrupt", "open_store"]


class StageNotFound(FileNotFoundError):
    """The stage has no manifest: it was never written, or its writer did not finish."""


class StageCorrupt(IOError):
    """A part named by the manifest is missing or differs from what the manifest recorded."""


_WRITTEN = [0]  # bytes this process has written to any object store (resource metrics read the delta)
_WRITTEN_LOCK = threading.Lock()


def bytes_written() -> int:
    """Bytes this process has written through :class:`ObjectStore` so far (all stores, all keys)."""
    return _WRITTEN[0]


class ObjectStore:
    """Keys are '/'-separated paths relative to the store root."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, uri: str):
        self.fs = fs
        self.root = root.rstrip("/")
        self.uri = uri.rstrip("/")
        self.is_local = isinstance(fs, LocalFileSystem)

    # -- paths --------------------------------------------------------------------------------
    def path(self, key: str) -> str:
        key = key.strip("/")
        if ".." in key.split("/"):
            raise ValueError(f"store key {key!r} may not contain '..'")
        return f"{self.root}/{key}" if key else self.root

    def url(self, key: str) -> str:
        """A URI a person or another process can use (s3://… or an absolute path)."""
        return f"{self.uri}/{key.strip('/')}"

    # -- bytes --------------------------------------------------------------------------------
    def put_bytes(self, key: str, data: bytes) -> None:
        path = self.path(key)
        if self.is_local:
            write_atomic(path, data)  # readers never see a partial file
        else:
            # An S3 PUT is atomic: the object appears whole or not at all.
            self.fs.pipe_file(path, data)
        with _WRITTEN_LOCK:
            _WRITTEN[0] += len(data)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self.path(key))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url(key)} does not exist") from None

    def exists(self, key: str) -> bool:
        return self.fs.exists(self.path(key))

    def list(self, prefix: str) -> list[str]:
        """Keys of the files under ``prefix`` (recursive), relative to the store root."""
        return sorted(self.sizes(prefix))

    def sizes(self, prefix: str) -> dict[str, int]:
        """Key → size in bytes of every file under ``prefix`` (recursive). Folder entries are left out: a filer
        such as SeaweedFS keeps an emptied folder, which ``find`` lists on its own."""
        try:
            found = self.fs.find(self.path(prefix), detail=True)
        except FileNotFoundError:
            return {}
        root = self.root + "/"
        return {(p[len(root):] if p.startswith(root) else p): int(info.get("size") or 0)
                for p, info in sorted(found.items()) if info.get("type") != "directory"}

    def key_of(self, url: str) -> str | None:
        """The key a URL from :meth:`url` names, or None when it points outside this store."""
        url, base = url.rstrip("/"), self.uri + "/"
        return url[len(base):] if url.startswith(base) else None

    def delete(self, prefix: str) -> None:
        path = self.path(prefix)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)
        if not self.is_local:
            self.fs.invalidate_cache()

    def put_json(self, key: str, obj: Any) -> None:
        self.put_bytes(key, json.dumps(obj, indent=2, sort_keys=True).encode())

    def get_json(self, key: str) -> Any:
        return json.loads(self.get_bytes(key))

    # -- folders (checkpoints) ----------------------------------------------------------------
    def upload_dir(self, local_dir: str | os.PathLike[str], prefix: str, *, link: bool = False) -> str:
        """Every file of ``local_dir`` under ``prefix`` (what was there before is deleted); ``link``: see
        :meth:`put_file`."""
        local_dir = Path(local_dir)
        self.delete(prefix)
        for p in sorted(local_dir.rglob("*")):
            if p.is_file():
                self.put_file(p, f"{prefix}/{p.relative_to(local_dir).as_posix()}", link=link)
        return self.url(prefix)

    def put_file(self, local: str | os.PathLike[str], key: str, *, link: bool = False) -> None:
        """A local file under ``key``, streamed (never whole in memory): copied by the kernel into a local store
        (:func:`copy_atomic`), uploaded by S3's multipart upload otherwise (the object appears whole or not at all).
        ``link``: a local store on the file's file system names the file itself (:func:`link_atomic`, nothing
        copied), for files nothing writes in place afterwards: a save point's state (half the disk writes)."""
        path, size = self.path(key), os.path.getsize(local)
        if self.is_local:
            if not (link and link_atomic(local, path)):
                copy_atomic(local, path)
        else:
            self.fs.put_file(str(local), path)
        with _WRITTEN_LOCK:
            _WRITTEN[0] += size

    def download_dir(self, prefix: str, local_dir: str | os.PathLike[str]) -> Path:
        local_dir = Path(local_dir)
        keys = self.list(prefix)
        if not keys:
            raise FileNotFoundError(f"{self.url(prefix)} holds no files")
        for key in keys:
            rel = posixpath.relpath(key, prefix.strip("/"))
            dest = local_dir / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if self.is_local:  # streamed, as put_file uploads: never a gigabyte of state whole in memory
                copy_atomic(self.path(key), dest, fsync=False)
            else:
                self.fs.get_file(self.path(key), str(dest))
        return local_dir

    # -- tables -------------------------------------------------------------------------------
    def write_table(self, key: str, table: pa.Table) -> str:
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        data = buf.getvalue()
        self.put_bytes(key, data)
        return hashlib.sha256(data).hexdigest()

    def read_table(self, key: str, schema: pa.Schema | None = None) -> pa.Table:
        table = pq.read_table(io.BytesIO(self.get_bytes(key)), schema=schema)
        return table

    # -- stages -------------------------------------------------------------------------------
    def write_stage(
        self,
        prefix: str,
        parts: Iterable[pa.Table],
        meta: dict[str, Any] | None = None,
        schema: pa.Schema | None = None,
    ) -> dict[str, Any]:
        """Write parts, then the manifest. Overwrites a previous (complete or partial) write."""
        prefix = prefix.strip("/")
        # Order matters: the manifest goes first, so a crash below leaves "not done", never a
        # manifest pointing at parts of two different writes.
        if self.exists(f"{prefix}/{MANIFEST}"):
            self.fs.rm(self.path(f"{prefix}/{MANIFEST}"))
        self.delete(prefix)
        entries = []
        rows = 0
        for i, table in enumerate(parts):
            if schema is not None:
                table = conform(table, schema, where=f"{self.url(prefix)} part {i}")
            name = f"part-{i:05d}.parquet"
            digest = self.write_table(f"{prefix}/{name}", table)
            entries.append({"name": name, "rows": table.num_rows, "sha256": digest})
            rows += table.num_rows
        manifest = {
            "parts": entries,
            "rows": rows,
            "schema": (schema.metadata or {}).get(b"rlpipe.table", b"").decode() if schema else None,
            "written_at": time.time(),
            "meta": meta or {},
        }
        self.put_json(f"{prefix}/{MANIFEST}", manifest)
        return manifest

    def stage_done(self, prefix: str) -> bool:
        return self.exists(f"{prefix.strip('/')}/{MANIFEST}")

    def read_manifest(self, prefix: str) -> dict[str, Any]:
        try:
            return self.get_json(f"{prefix.strip('/')}/{MANIFEST}")
        except FileNotFoundError:
            raise StageNotFound(
                f"stage {self.url(prefix)} has no {MANIFEST}: it was never written or its writer did not finish"
            ) from None

    def read_stage(self, prefix: str, schema: pa.Schema | None = None, verify: bool = True) -> pa.Table:
        """Read exactly the parts the manifest names (and check their sha256)."""
        prefix = prefix.strip("/")
        manifest = self.read_manifest(prefix)
        tables = []
        for entry in manifest["parts"]:
            key = f"{prefix}/{entry['name']}"
            try:
                data = self.get_bytes(key)
            except FileNotFoundError:
                raise StageCorrupt(f"{self.url(key)} is named by the manifest but missing") from None
            if verify and hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise StageCorrupt(f"{self.url(key)} differs from the sha256 in its manifest")
            tables.append(pq.read_table(io.BytesIO(data), schema=schema))
        if not tables:
            if schema is None:
                raise StageCorrupt(f"stage {self.url(prefix)} has no parts and no schema was given")
            return schema.empty_table()
        return pa.concat_tables(tables, promote_options="none" if schema is not None else "default")


def conform(table: pa.Table, schema: pa.Schema, where: str = "table") -> pa.Table:
    """Select and cast ``table``'s columns to ``schema``; missing required columns are an error."""
    cols = []
    for field in schema:
        if field.name in table.column_names:
            col = table.column(field.name)
            try:
                col = col.cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise ValueError(f"{where}: column '{field.name}' cannot be read as {field.type}: {e}") from None
            if not field.nullable and col.null_count:
                raise ValueError(f"{where}: column '{field.name}' has {col.null_count} null value(s)")
        elif field.nullable:
            col = pa.nulls(table.num_rows, field.type)
        else:
            raise ValueError(f"{where}: required column '{field.name}' is missing")
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=schema)


def open_store(uri: str | None = None, cfg_settings: Settings | None = None) -> ObjectStore:
    """Open a local folder (path or file://) or an S3 prefix (s3://bucket/prefix).

    The S3 endpoint comes from RLPIPE_S3_ENDPOINT_URL; credentials from RLPIPE_S3_ACCESS_KEY_ID /
    RLPIPE_S3_SECRET_ACCESS_KEY / RLPIPE_S3_SESSION_TOKEN (AWS_* as fallback), else botocore's default chain
    (see :mod:`rlpipe.storage.credentials`); none at all is an :class:`S3CredentialsError` naming the fix.
    """
    s = cfg_settings or read_settings()
    uri = uri or s.resolve_storage_uri()
    if uri.startswith("s3://"):
        import s3fs  # lazy: only S3 users pay for aiobotocore

        client_kwargs: dict[str, Any] = {}
        if s.s3_endpoint_url:
            client_kwargs["endpoint_url"] = s.s3_endpoint_url
        if s.s3_region:
            client_kwargs["region_name"] = s.s3_region
        fs = s3fs.S3FileSystem(
            **resolve_s3_credentials(s).fs_kwargs(),
            client_kwargs=client_kwargs,
            config_kwargs={"connect_timeout": 10, "read_timeout": 60, "retries": {"max_attempts": 3}},
            use_listings_cache=False,
        )
        return ObjectStore(fs, uri[len("s3://"):], uri)
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    root = str(Path(uri).expanduser().resolve())
    os.makedirs(root, exist_ok=True)
    return ObjectStore(fsspec.filesystem("file"), root, root)
