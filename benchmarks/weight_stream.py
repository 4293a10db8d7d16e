"""Weight sync to rollout replicas: the object-store round-trip against bucketed HTTP streaming (issue 43).

    .venv/bin/python benchmarks/weight_stream.py --out /tmp/rlpipe-bench/weight-stream
    .venv/bin/python benchmarks/weight_stream.py --models 3M --replicas 1 --repeats 3     # a quick look

For each model of ``--models`` (scaling.py's configs, untrained: ``3M`` is the demo's default ModelConfig,
~3.4M parameters; ``100M`` is hidden 768 × 12 layers, ~113M) two weight sets (seeds 0 and 1, fp32
safetensors) are saved once under --out. Then 1 and 2 replicas (``--replicas``) of
``rlpipe serve rollout --engine hf`` start, each a process of its own on 127.0.0.1 (one thread each, one
local-folder store shared with this process), and each repeat times, alternating the two sets so that every
load changes the weights, three ways to put a set on every replica:

  store   the path before streaming: ``upload_weights`` (hash the folder, put its files in the store under
          runs/<run>/weights/<sha>), then every replica's ``/weights`` in parallel (download, hash, reload,
          read back); the upload is deleted afterwards, untimed.
  folder  ``ReplicatedEngine.load_weights(folder)``: read and hash the folder once, encode each 64 MiB bucket
          once (the next while one is sent), stream them to every replica in parallel; each replica decodes
          a bucket as it arrives, hashes the whole at the commit and reloads.
  memory  ``ReplicatedEngine.load_tensors(tensors, sha256)`` with the tensors and their hash already at
          hand: the run's sync with an in-process trainer (its hash is computed anyway, as the version).

Medians of ``--repeats`` (≥3) per cell; writes results.json and tables.md in --out and prints the table.
Timings are only comparable on an otherwise idle machine: say what else ran beside the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT), str(ROOT / "benchmarks")]  # this checkout's code, not the installed one

from disaggregated import CLI, _env, _start, _stop  # noqa: E402 - the service processes, as that benchmark starts them
from scaling import MODELS  # noqa: E402 - the model configs of the scaling benchmark

WAYS = ("store", "folder", "memory")


def weight_sets(out: Path, name: str) -> tuple[list[Path], int, float]:
    """Two untrained weight sets of model ``name`` (built once), its parameter count and its safetensors MB."""
    from rlpipe.config import ModelConfig
    from rlpipe.training.checkpoint import save_checkpoint
    from rlpipe.training.tiny import build_char_tokenizer, build_tiny_model

    folders, params = [out / "models" / name / f"seed{s}" for s in (0, 1)], 0
    tok = build_char_tokenizer()
    for seed, folder in enumerate(folders):
        if not (folder / "config.json").exists() or not params:
            model = build_tiny_model(ModelConfig(**MODELS[name]), tok, seed=seed)
            params = sum(p.numel() for p in model.parameters())
            if not (folder / "config.json").exists():
                save_checkpoint(folder, model, tok, trainer_state={"kind": "init"})
            del model
    mb = sum(f.stat().st_size for f in folders[0].glob("*.safetensors")) / 1e6
    return folders, params, mb


def start_replicas(out: Path, folder: Path, n: int, store_uri: str) -> tuple[list, list[str]]:
    """``n`` HF rollout services on ``folder``, each a process of its own; (processes, URLs)."""
    from tests.helpers.s3server import free_port

    procs, urls = [], []
    for i in range(n):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = _env(out / "homes" / f"replica{i}", store_uri, {"OMP_NUM_THREADS": "1"})
        cmd = [sys.executable, "-c", CLI, "serve", "rollout", str(folder), "--engine", "hf", "--port", str(port)]
        procs.append(_start(cmd, env, out / f"replica{i}.log", [url]))
        urls.append(url)
    return procs, urls


def one_sync(way: str, engine, store, folder: Path, held: dict) -> float:
    """Seconds for one way to put ``folder``'s weights on every replica of ``engine``; checks they hold them."""
    from rlpipe.rollout.remote import upload_weights

    t = time.perf_counter()
    if way == "store":
        uri, sha = upload_weights(store, "bench", folder)
        got = engine.load_uri(uri, sha)
    elif way == "folder":
        got, sha = engine.load_weights(folder), held[folder][1]
    else:
        tensors, sha = held[folder]
        got = engine.load_tensors(tensors, sha)
    seconds = time.perf_counter() - t
    if got != sha:
        raise RuntimeError(f"{way}: the replicas hold {got[:12]}, not {sha[:12]}")
    store.delete("runs/bench")
    return seconds


def measure(out: Path, name: str, n: int, repeats: int) -> dict:
    """Medians of each way for model ``name`` on ``n`` replicas."""
    from rlpipe.rollout.remote import RemoteEngine, ReplicatedEngine
    from rlpipe.storage import open_store
    from rlpipe.storage.weights import load_safetensors_folder, weights_digest

    folders, params, mb = weight_sets(out, name)
    store = open_store(str(out / "store"))
    held = {f: (t := load_safetensors_folder(f), weights_digest(t)) for f in folders}
    procs, urls = start_replicas(out, folders[0], n, store.uri)
    try:
        engine = ReplicatedEngine([RemoteEngine(u, store, "bench", timeout_s=1800) for u in urls])
        times: dict[str, list[float]] = {w: [] for w in WAYS}
        for r in range(repeats):
            for k, way in enumerate(WAYS):  # every load changes the weights: the set alternates
                times[way].append(one_sync(way, engine, store, folders[(r * len(WAYS) + k + 1) % 2], held))
    finally:
        for p in procs:
            _stop(p)
    row = {"model": name, "params": params, "mb": mb, "replicas": n, "repeats": repeats,
           **{f"{w}_s": statistics.median(times[w]) for w in WAYS}, "all": times}
    print(json.dumps({k: v for k, v in row.items() if k != "all"}), flush=True)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model (params, fp32 MB) | replicas | store round-trip s | stream from folder s | stream from memory s | store ÷ memory |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} ({r['params'] / 1e6:.1f}M, {r['mb']:.0f} MB) | {r['replicas']} | {r['store_s']:.2f} | "
                     f"{r['folder_s']:.2f} | {r['memory_s']:.2f} | {r['store_s'] / r['memory_s']:.1f}× |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/rlpipe-bench/weight-stream"))
    ap.add_argument("--models", default="3M,100M", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--replicas", default="1,2", help="comma-separated replica counts")
    ap.add_argument("--repeats", type=int, default=3, help="syncs per way and cell (the median is reported); at least 3")
    a = ap.parse_args()
    unknown = set(a.models.split(",")) - set(MODELS)
    if unknown or a.repeats < 3:
        ap.error(f"--models: {sorted(unknown)} not among {list(MODELS)}" if unknown else "--repeats: give at least 3")
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = {"date": str(date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
               "load_average_at_start": os.getloadavg(), "args": {k: str(v) for k, v in vars(a).items()}}
    rows = [measure(out, m, int(n), a.repeats) for m in a.models.split(",") for n in a.replicas.split(",")]
    results |= {"rows": rows, "load_average_at_end": os.getloadavg()}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "tables.md").write_text(table(rows) + "\n")
    print(table(rows))
    print(f"load average at start {results['load_average_at_start']}, at end {results['load_average_at_end']}")


if __name__ == "__main__":
    main()
