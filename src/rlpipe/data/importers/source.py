"""Reading SRC: a file (JSON lines, also gzipped, JSON or Parquet), a folder of them, a ``datasets``
folder or a Hugging Face hub name, row by row with the split its name implies."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any, Iterator

import pyarrow.parquet as pq

from rlpipe.data.importers.rows import DataImportError, Row


def split_from_name(name: str) -> str | None:
    """rlpipe's split for a file or hub split name: ``test.jsonl`` → test, ``train_prefs`` → train, ``valid`` → validation."""
    words = set(re.split(r"[^a-z]+", name.lower()))
    if words & {"test", "eval"}:
        return "test"
    if words & {"validation", "valid", "val", "dev"}:
        return "validation"
    return "train" if "train" in words else None


def _file_objects(path: Path) -> list[dict[str, Any]]:
    """The objects of one file: JSON lines (also gzipped), a JSON list or object, or Parquet."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001
            raise DataImportError(f"{path}: not a readable Parquet file: {e}") from None
    opener = gzip.open if name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataImportError(f"{path}: cannot read it ({e}); give a .jsonl, .jsonl.gz, .json or .parquet file") from None
    if name.endswith(".json"):
        try:
            data = json.loads(text)
            return data if isinstance(data, list) else [data]
        except json.JSONDecodeError:
            pass  # some .json files are JSON lines
    objects = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                objects.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataImportError(f"{path} line {n}: not valid JSON ({e.msg}); each line must be one JSON object") from None
    return objects


def _hf_datasets():
    """The Hugging Face ``datasets`` library, or None. A folder named ``datasets`` on sys.path imports as an
    empty namespace package, hence the check for ``load_dataset``."""
    try:
        import datasets
    except ImportError:
        return None
    return datasets if hasattr(datasets, "load_dataset") else None


def _hub_rows(src: str, split: str) -> list[dict[str, Any]]:
    datasets = _hf_datasets()
    if datasets is None:
        raise DataImportError(f"{src}: no such file or folder, and the `datasets` library is not installed to read it "
                              "from the hub; `pip install datasets`, or download the file and give its path")
    path = Path(src)
    try:
        ds = datasets.load_from_disk(str(path)) if path.is_dir() else datasets.load_dataset(src, split=split)
    except Exception as e:  # noqa: BLE001 - hub, network and format errors all end the import the same way
        raise DataImportError(f"{src}: the `datasets` library could not load it ({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataImportError(f"{src}: has splits {sorted(ds)}, not {split!r}; choose one with --split")
        ds = ds[split]
    return [dict(r) for r in ds]


def read_source(src: str | Path, split: str | None = None, hub_split: str = "train") -> Iterator[tuple[Row, str | None]]:
    """Each row of SRC with the split its file name implies (None: unknown). SRC is a file, a folder of
    .json/.jsonl files (MATH's layout: each file's path is its row's id), a ``save_to_disk`` folder,
    or a hub name (needs ``datasets``; the hub split read is ``split``, else ``hub_split``)."""
    path = Path(src)
    if path.is_file():
        for i, obj in enumerate(_file_objects(path)):
            yield Row(f"{path} row {i + 1}", i, obj), split_from_name(path.name)
    elif path.is_dir() and not (path / "dataset_info.json").exists() and not (path / "dataset_dict.json").exists():
        files = sorted(p for p in path.rglob("*") if p.is_file() and re.search(r"\.(jsonl?|jsonl\.gz|parquet)$", p.name))
        if not files:
            raise DataImportError(f"{path}: no .json, .jsonl or .parquet files in this folder")
        index, base = 0, path.parent if split_from_name(path.name) else path  # MATH/test/algebra/1.json → test/algebra/1
        for file in files:
            rel = file.relative_to(base).as_posix()
            for n, obj in enumerate(_file_objects(file), start=1):
                yield Row(f"{file} row {n}", index, obj, rel.rsplit(".", 1)[0] if file.suffix == ".json" else None), \
                    split_from_name(rel)
                index += 1
    else:
        for i, obj in enumerate(_hub_rows(str(src), split or hub_split)):
            yield Row(f"{src} row {i + 1}", i, obj), split_from_name(split or hub_split)
