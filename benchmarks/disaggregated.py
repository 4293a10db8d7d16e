"""Cost of the split: an RL iteration with the rollout engine in-process and as a service, stage by stage,
and the weight transfer through the object store against model size.

    .venv/bin/python benchmarks/disaggregated.py --out /tmp/rlpipe-bench/split

About 15 min on a shared 2-core CPU machine, 7 of them the SFT base (kept in --out and reused on the next call).

1. Trains a small SFT base once (the demo's shape, 3.4M parameters, ``--sft-steps`` steps; kept in --out),
   then runs the same RL config twice as ``rlpipe run`` processes (arithmetic, ``--iterations`` of 32
   prompts × 8 samples, vLLM, seed 0): with the engine in the run's process, and with RLPIPE_ROLLOUT_URL
   pointing at one ``rlpipe serve rollout --engine vllm`` replica in its own process (its own RLPIPE_HOME,
   the run's RLPIPE_STORAGE_URI). Stage means come from each run's progress.json, without the first
   iteration (it carries one-off warm-ups) and without the held-out evaluation.
2. For tiny Qwen2 models of growing size (``--sizes`` hidden×layers), the store path alone:
   ``upload_weights`` into a local-folder store and into a SeaweedFS S3 server on 127.0.0.1, then the
   service's ``/weights`` (download, sha256 check, the engine's in-place reload) on a rollout service in a
   process of its own: the project's RolloutService and app on a vLLM engine, with a timer around the
   engine's reload. ``--repeats`` loads per store, alternating two weight sets so every load changes the
   weights; medians are reported.
3. ``--trainer``: the same RL config in-process, then with RLPIPE_TRAINER_URL pointing at ``rlpipe serve trainer``
   with 1 and with 2 ranks (the engine in the run's process in all three; micro-batches of 32 so that 2 ranks
   split each step's 64 samples): the update, its save and upload
   to the store, the run's checked copy of the new weights, and whether the final weights match.
Writes results.json and tables.md in --out. Timings are only comparable on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = "import sys; from rlpipe.cli import main; sys.argv = ['rlpipe'] + sys.argv[1:]; main()"
STAGES = ("generate_s", "verify_s", "update_s", "sync_s", "save_s", "overhead_s", "total_s")


# -- processes ---------------------------------------------------------------------------------
def _env(home: Path, store: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """A child's environment: its own RLPIPE_HOME, the given store, no service URL inherited from the shell."""
    drop = ("RLPIPE_ROLLOUT_URL", "RLPIPE_TRAINER_URL", "RLPIPE_VERIFIER_URL", "RLPIPE_REWARD_MODEL_URL", "RLPIPE_ENV_URL", "RLPIPE_TRACKING_URI",
            "PREFECT_API_URL", "MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    (home / "prefect").mkdir(parents=True, exist_ok=True)  # Prefect creates its home without parents
    env |= {"RLPIPE_HOME": str(home), "RLPIPE_STORAGE_URI": store, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}",
            "PREFECT_HOME": str(home / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
            "PREFECT_LOGGING_LEVEL": "WARNING"}
    return env | (extra or {})


def _start(cmd: list[str], env: dict[str, str], log: Path, urls: list[str], timeout_s: float = 300.0) -> subprocess.Popen:
    """A service process (its own session, so that it is stopped with everything it started), once every
    one of ``urls`` answers /health."""
    import httpx

    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("w"), start_new_session=True)
    deadline, todo = time.monotonic() + timeout_s, list(urls)
    while todo and time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"service exited with {proc.returncode}; see {log}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{todo[0]}/health", timeout=1).status_code == 200:
                todo.pop(0)
                continue
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    if todo:
        _stop(proc)
        raise RuntimeError(f"{todo[0]} was not healthy after {timeout_s:g} s; see {log}")
    return proc


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group this script started (by its id), SIGKILL if it lingers."""
    from rlpipe.procs import stop_group

    stop_group(proc)


def _start_s3(workdir: Path):
    """tests/helpers' SeaweedFS server. Its Iceberg and Lance listeners take fixed ports (8181, 9101), so a
    second weed server on the machine (another test session) makes it exit: they are turned off here."""
    import tests.helpers.s3server as s3

    original = s3.weed_binary
    wrapper = workdir.parent / "weed-no-catalogs.sh"
    wrapper.write_text(f'#!/bin/sh\nexec "{original()}" "$@" -s3.port.iceberg=0 -s3.port.lance=0\n')
    wrapper.chmod(0o755)
    s3.weed_binary = lambda: str(wrapper)  # exec keeps the PID: the server is still stopped by its object
    try:
        return s3.start_s3_server(workdir)
    finally:
        s3.weed_binary = original


# -- 1. the same run, in-process and on a rollout service ---------------------------------------
def base_model(out: Path, steps: int) -> Path:
    """The demo-shaped tiny Qwen2 after ``steps`` SFT steps on the arithmetic train split (built once)."""
    folder = out / f"base-sft{steps}"
    if (folder / "config.json").exists():
        return folder
    import torch

    from rlpipe.config import DataConfig, ModelConfig, SFTConfig
    from rlpipe.data import build_arithmetic
    from rlpipe.training.checkpoint import save_checkpoint
    from rlpipe.training.sft import train_sft
    from rlpipe.training.tiny import build_char_tokenizer, build_tiny_model

    torch.set_num_threads(2)
    rows = [r for r in build_arithmetic(DataConfig()).to_pylist() if r["split"] == "train"]
    tok = build_char_tokenizer()
    model = build_tiny_model(ModelConfig(), tok, seed=0)
    t = time.perf_counter()
    train_sft(model, tok, rows, SFTConfig(steps=steps, stop_at_accuracy=None, eval_every=steps), seed=0)
    print(f"[bench] SFT base: {steps} steps in {time.perf_counter() - t:.0f} s", flush=True)
    save_checkpoint(folder, model, tok, trainer_state={"kind": "sft"})
    return folder


def _pinned(cmd: list[str], cpus: str | None) -> list[str]:
    """``cmd`` run on ``cpus`` only (``taskset -c``), or as it is."""
    return ["taskset", "-c", cpus, *cmd] if cpus else cmd


def rl_run(run_id: str, base: Path, iterations: int, env: dict[str, str], log: Path, extra: tuple[str, ...] = (),
           cpus: str | None = None) -> dict:
    """``rlpipe run`` in a process of its own (on ``cpus``, where given): (summary, per-stage mean seconds per
    iteration, wall s)."""
    sets = [f"task.policy_model={base}", "rollout.engine=vllm", f"train.total_iterations={iterations}",
            f"train.save_interval={iterations}", f"train.eval_interval={iterations}", "seed=0",
            "tracking.experiment=split-bench", "task.name=split-bench", *extra]
    t, load_before = time.perf_counter(), os.getloadavg()[0]
    res = subprocess.run(_pinned([sys.executable, "-c", CLI, "run", "--run-id", run_id] + [x for s in sets for x in ("--set", s)], cpus),
                         env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, start_new_session=True)
    wall = time.perf_counter() - t
    if res.returncode != 0:
        raise RuntimeError(f"rlpipe run {run_id} exited with {res.returncode}; see {log}:\n{log.read_text()[-3000:]}")
    summary = json.loads(Path(res.stdout.strip().splitlines()[-1]).read_text())
    from rlpipe.history import read_history

    history = read_history(Path(env["RLPIPE_HOME"]) / "runs" / run_id)
    return {"summary": summary, "stages": stage_means(history), "wall_s": round(wall, 1), "history": history,
            "load_average_1min": [load_before, os.getloadavg()[0]]}  # the machine's load before and after (2 cores)


def stage_means(history: list[dict]) -> dict[str, float]:
    """Mean seconds per iteration by stage, iterations 2.. (the first carries warm-ups), evaluation left out.
    overhead_s is the iteration's time outside generation, scoring and the optimizer: it includes sync and save."""
    steady = history[1:] or history

    def mean(f) -> float:
        return round(statistics.fmean(f(h) for h in steady), 3)

    total = lambda h: h.get("time/iteration_total_s", h["time/iteration_s"]) - h["time/eval_s"]  # noqa: E731
    out = {k: mean(lambda h, k=k: h[f"time/{k}"]) for k in STAGES[:5]}
    out["overhead_s"] = mean(lambda h: total(h) - h["time/generate_s"] - h["time/verify_s"] - h["time/update_s"])
    out["total_s"] = mean(total)
    out["ahead_generate_s"] = mean(lambda h: h.get("rollout/ahead_generate_s", 0.0))  # rollout.async_steps: beside the update
    return out


def compare_runs(out: Path, base: Path, iterations: int, stamp: str, extra: tuple[str, ...] = (),
                 pin: tuple[str, str] | None = None) -> dict:
    """The same config, engine in-process, then one vLLM replica behind `rlpipe serve rollout`; ``pin``: the
    remote run's (run, replica) CPUs, so that generation and the update each have cores of their own."""
    from tests.helpers.s3server import free_port

    store = str(out / "store")
    home = out / "home-run"
    runs = {"in_process": rl_run(f"split-local-{stamp}", base, iterations, _env(home, store), out / "run-local.log", extra)}
    print(f"[bench] in-process run: {runs['in_process']['stages']}", flush=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t = time.perf_counter()
    proc = _start(_pinned([sys.executable, "-c", CLI, "serve", "rollout", str(base), "--engine", "vllm", "--port", str(port)],
                          pin and pin[1]), _env(out / "home-service", store), out / "serve-rollout.log", [url])
    start_s = time.perf_counter() - t
    try:
        runs["remote"] = rl_run(f"split-remote-{stamp}", base, iterations, _env(home, store, {"RLPIPE_ROLLOUT_URL": url}),
                                out / "run-remote.log", extra, pin and pin[0])
        runs["remote"]["pinned"] = {"run": pin[0], "replica": pin[1]} if pin else None
    finally:
        _stop(proc)
    runs["remote"]["service_start_s"] = round(start_s, 1)
    print(f"[bench] remote run: {runs['remote']['stages']}", flush=True)
    a, b = runs["in_process"]["summary"], runs["remote"]["summary"]
    runs["same_final_weights"] = a["final_policy_version"] == b["final_policy_version"]
    runs["same_heldout_accuracy"] = a["heldout_accuracy_final"] == b["heldout_accuracy_final"]
    return runs


def compare_trainer(out: Path, base: Path, iterations: int, stamp: str) -> dict:
    """The same config with the trainer in the run's process, then as a 1-rank and a 2-rank trainer service."""
    from tests.helpers.s3server import free_port

    store, home = str(out / "store"), out / "home-run"
    extra = ("train.micro_batch_size=32",)  # 64 samples per step over 2 ranks: 32 each (the same steps on 1 rank)
    runs = {"in_process": rl_run(f"trainer-local-{stamp}", base, iterations, _env(home, store), out / "run-trainer-local.log",
                                 extra)}
    for nproc in (1, 2):
        port = free_port()
        url, t = f"http://127.0.0.1:{port}", time.perf_counter()
        proc = _start([sys.executable, "-c", CLI, "serve", "trainer", "--nproc", str(nproc), "--port", str(port)],
                      _env(out / f"home-trainer{nproc}", store), out / f"serve-trainer{nproc}.log", [url])
        start_s = time.perf_counter() - t
        try:
            run = rl_run(f"trainer-svc{nproc}-{stamp}", base, iterations, _env(home, store, {"RLPIPE_TRAINER_URL": url}),
                         out / f"run-trainer{nproc}.log", extra)
        finally:
            _stop(proc)
        steady = run["history"][1:] or run["history"]
        run["service_start_s"] = round(start_s, 1)
        run["trainer_upload_s"] = round(statistics.fmean(h["trainer/upload_s"] for h in steady), 3)
        run["trainer_fetch_s"] = round(statistics.fmean(h["trainer/fetch_s"] for h in steady), 3)
        runs[f"service_{nproc}"] = run
        print(f"[bench] trainer service, {nproc} rank(s): {run['stages']}", flush=True)
    final = {k: v["summary"]["final_policy_version"] for k, v in runs.items()}
    runs["final_weights"] = final
    return runs


def trainer_table(runs: dict) -> str:
    cols = [("in_process", "trainer in the run's process"), ("service_1", "`serve trainer --nproc 1`"),
            ("service_2", "`serve trainer --nproc 2`")]
    names = {"update_s": "update (optimizer steps; service: + reading the trajectories from the store)",
             "save_s": "save (resumable state; service: + each rank's upload to the store)", "sync_s": "sync (reload + hash + probe)",
             "overhead_s": "overhead: all but generate/verify/update (includes sync, save and the run's copy of the weights)",
             "generate_s": "generate", "total_s": "iteration total"}
    lines = ["| seconds per iteration (mean of iterations 2–N, evaluation left out) | " + " | ".join(c for _, c in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for k, name in names.items():
        lines.append(f"| {name} | " + " | ".join(f"{runs[c]['stages'][k]:.3f}" for c, _ in cols) + " |")
    lines.append("| of which the upload of the state (service) | – | " + " | ".join(f"{runs[c]['trainer_upload_s']:.3f}" for c, _ in cols[1:]) + " |")
    lines.append("| of which the run's checked copy of the new weights (service) | – | " + " | ".join(f"{runs[c]['trainer_fetch_s']:.3f}" for c, _ in cols[1:]) + " |")
    fw = runs["final_weights"]
    lines += ["", "- final weights (sha256): " + ", ".join(f"{c} {fw[c][:12]}" for c, _ in cols),
              "- held-out accuracy base → final: " + ", ".join(
                  f"{c} {runs[c]['summary']['heldout_accuracy_base']:.1%} → {runs[c]['summary']['heldout_accuracy_final']:.1%}" for c, _ in cols),
              "- service start: " + ", ".join(f"{c} {runs[c]['service_start_s']:.0f} s" for c, _ in cols[1:])]
    return "\n".join(lines)


# -- 2. the store path alone, against model size -------------------------------------------------
def serve_timed(model_dir: str, stores: list[str], ports: list[int], timings: Path) -> None:
    """One RolloutService per store, all on one vLLM engine in this process; each engine reload's seconds
    are appended to ``timings`` (the service's own ``load_s`` also counts the download and the hash check)."""
    import threading

    import uvicorn

    from rlpipe.rollout.engines import new_engine
    from rlpipe.services.rollout import RolloutService, create_app
    from rlpipe.storage import open_store

    engine = new_engine("vllm", model_dir, max_model_len=64, seed=0)
    reload = engine.load_weights

    def timed(folder):
        t = time.perf_counter()
        held = reload(folder)
        with timings.open("a") as f:
            f.write(json.dumps({"reload_s": time.perf_counter() - t}) + "\n")
        return held

    engine.load_weights = timed
    for store, port in zip(stores, ports):
        service = RolloutService(engine, model_dir, open_store(store), max_model_len=64)
        server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
    threading.Event().wait()  # until SIGTERM


def checkpoints(folder: Path, hidden: int, layers: int) -> tuple[list[Path], int]:
    """Two tiny Qwen2 checkpoints of one shape (seeds 0 and 1), so that consecutive loads change the weights."""
    from rlpipe.config import ModelConfig
    from rlpipe.training.checkpoint import save_checkpoint
    from rlpipe.training.tiny import build_char_tokenizer, build_tiny_model, count_parameters

    cfg = ModelConfig(hidden_size=hidden, num_layers=layers, num_heads=max(1, hidden // 64), intermediate_size=3 * hidden)
    tok = build_char_tokenizer()
    out = []
    for seed in (0, 1):
        model = build_tiny_model(cfg, tok, seed=seed)
        params = count_parameters(model)
        save_checkpoint(folder / f"seed{seed}", model, tok)
        out.append(folder / f"seed{seed}")
        del model
    return out, params


def transfer(store, url: str, folder: Path, run_id: str, timings: Path) -> dict[str, float]:
    """One sync through the store as a run does it: upload (hash + put), then the service's /weights."""
    import httpx

    from rlpipe.rollout.remote import upload_weights

    t = time.perf_counter()
    uri, sha = upload_weights(store, run_id, folder)
    upload_s = time.perf_counter() - t
    t = time.perf_counter()
    r = httpx.post(f"{url}/weights", json={"uri": uri, "sha256": sha}, timeout=1800)
    wall = time.perf_counter() - t
    if r.status_code != 200 or r.json()["version"] != sha:
        raise RuntimeError(f"{url}/weights: HTTP {r.status_code}: {r.text[:500]}")
    load_s = r.json()["load_s"]
    reload_s = json.loads(timings.read_text().splitlines()[-1])["reload_s"]
    store.delete(f"runs/{run_id}")
    return {"upload_s": upload_s, "download_verify_s": load_s - reload_s, "reload_s": reload_s,
            "request_s": wall - load_s, "total_s": upload_s + wall}


def sweep_size(out: Path, hidden: int, layers: int, repeats: int, stamp: str) -> list[dict]:
    """Both stores for one model size; a fresh S3 server per size (the helper's holds about 1.2 GB)."""
    import shutil

    from rlpipe.storage import open_store
    from rlpipe.storage.weights import file_weights_digest
    from tests.helpers.s3server import free_port

    label = f"h{hidden}-l{layers}"
    work = out / "sweep" / label
    shutil.rmtree(work, ignore_errors=True)
    folders, params = checkpoints(work / "models", hidden, layers)
    mb = sum(f.stat().st_size for f in folders[0].glob("*.safetensors")) / 1e6
    t = time.perf_counter()
    file_weights_digest(folders[0])
    hash_s = time.perf_counter() - t
    srv = _start_s3(work / "s3")
    os.environ.update(srv.env())
    stores = {"local folder": str(work / "store"), "S3 (SeaweedFS)": f"s3://{srv.bucket}/sweep"}
    ports = [free_port() for _ in stores]
    timings = work / "reload.jsonl"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", str(folders[0]), "--stores", ",".join(stores.values()),
           "--ports", ",".join(map(str, ports)), "--timings", str(timings)]
    rows, k = [], 0
    try:
        proc = _start(cmd, _env(work / "home-service", stores["local folder"], srv.env()), work / "service.log",
                      [f"http://127.0.0.1:{p}" for p in ports])
        try:
            for (name, uri), port in zip(stores.items(), ports):
                store, reps = open_store(uri), []
                for _ in range(repeats):
                    k += 1
                    reps.append(transfer(store, f"http://127.0.0.1:{port}", folders[k % 2], f"sweep-{stamp}-{k}", timings))
                med = {key: round(statistics.median(r[key] for r in reps), 3) for key in reps[0]}
                rows.append({"model": label, "params": params, "mb": round(mb, 1), "store": name, "hash_s": round(hash_s, 3)}
                            | med | {"mb_per_s": round(mb / med["total_s"], 1), "repeats": reps})
                print(f"[bench] {label} ({params / 1e6:.1f}M, {mb:.0f} MB) {name}: {med}", flush=True)
        finally:
            _stop(proc)
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    return rows


def fit(xs: list[float], ys: list[float]) -> dict[str, float]:
    """Least squares y = slope·x + intercept, with r²."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    ss = sum((y - my) ** 2 for y in ys)
    r2 = 1 - sum((y - slope * x - intercept) ** 2 for x, y in zip(xs, ys)) / ss if ss else 1.0
    return {"slope_s_per_mb": slope, "intercept_s": intercept, "r2": r2}


def fits(rows: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """Per store, seconds against MB for the total and each part."""
    out = {}
    for store in dict.fromkeys(r["store"] for r in rows):
        mine = [r for r in rows if r["store"] == store]
        out[store] = {k: fit([r["mb"] for r in mine], [r[k] for r in mine])
                      for k in ("upload_s", "download_verify_s", "reload_s", "total_s")}
    return out


# -- report --------------------------------------------------------------------------------------
def runs_table(runs: dict) -> str:
    a, b = runs["in_process"], runs["remote"]
    names = {"generate_s": "generate", "verify_s": "verify", "update_s": "update (optimizer)",
             "sync_s": "sync (reload + hash + probe; remote: + upload, download, hash check)", "save_s": "save (resumable state)",
             "overhead_s": "overhead: all but generate/verify/update (includes sync and save)", "total_s": "iteration total",
             "ahead_generate_s": "generation of the next batch beside the update (rollout.async_steps: 1; not in the total)"}
    lines = ["| seconds per iteration (mean of iterations 2–N, evaluation left out) | in-process vLLM | 1 `serve rollout` replica (vLLM) | remote − in-process |",
             "|---|---:|---:|---:|"]
    for k, name in names.items():
        lines.append(f"| {name} | {a['stages'][k]:.3f} | {b['stages'][k]:.3f} | {b['stages'][k] - a['stages'][k]:+.3f} |")
    sa, sb = a["summary"], b["summary"]
    lines += ["", f"- held-out accuracy base → final: in-process {sa['heldout_accuracy_base']:.1%} → {sa['heldout_accuracy_final']:.1%}, "
              f"remote {sb['heldout_accuracy_base']:.1%} → {sb['heldout_accuracy_final']:.1%}",
              f"- final weights identical (sha256): {runs['same_final_weights']} "
              f"({sa['final_policy_version'][:12]} vs {sb['final_policy_version'][:12]})",
              f"- run wall time: in-process {a['wall_s']:.0f} s, remote {b['wall_s']:.0f} s (+ {b['service_start_s']:.0f} s to start the service)"]
    return "\n".join(lines)


def sweep_table(rows: list[dict], fitted: dict) -> str:
    lines = ["| model (hidden × layers) | parameters | MB | store | upload s (of which hash) | download + verify s | reload s | request s | total s | MB/s |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['mb']:.1f} | {r['store']} | {r['upload_s']:.3f} ({r['hash_s']:.3f}) | "
                     f"{r['download_verify_s']:.3f} | {r['reload_s']:.3f} | {r['request_s']:.3f} | {r['total_s']:.3f} | {r['mb_per_s']:.0f} |")
    lines += ["", "| store | part | slope ms/MB | intercept s | r² |", "|---|---|---:|---:|---:|"]
    for store, parts in fitted.items():
        for part, f in parts.items():
            lines.append(f"| {store} | {part[:-2]} | {1000 * f['slope_s_per_mb']:.2f} | {f['intercept_s']:.3f} | {f['r2']:.4f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/rlpipe-bench/split"), help="folder for results.json, tables.md and the runs")
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--sizes", default="256x4,512x4,768x6,1024x7", help="hidden×layers of the transfer sweep")
    ap.add_argument("--repeats", type=int, default=3, help="loads per store and size (the median is reported)")
    ap.add_argument("--skip-runs", action="store_true")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--base", type=Path, help="an SFT base model folder to use instead of training one")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override of the runs of step 1 (repeatable), e.g. rollout.async_steps=1")
    ap.add_argument("--pin", metavar="RUN_CPUS/REPLICA_CPUS",
                    help="the remote run on RUN_CPUS and the replica on REPLICA_CPUS (taskset lists), e.g. 0/1")
    ap.add_argument("--trainer", action="store_true", help="also compare the trainer in-process and as a 1- and 2-rank service")
    ap.add_argument("--serve", help=argparse.SUPPRESS)  # internal: the timed service process of the sweep
    ap.add_argument("--stores", help=argparse.SUPPRESS)
    ap.add_argument("--ports", help=argparse.SUPPRESS)
    ap.add_argument("--timings", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return serve_timed(a.serve, a.stores.split(","), [int(p) for p in a.ports.split(",")], a.timings)
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this checkout's code, a worktree's too (not the installed one)
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    stamp, start = time.strftime("%Y%m%d-%H%M%S"), time.perf_counter()
    results: dict = {"date": str(date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
                     "load_average_at_start": os.getloadavg(), "args": {k: str(v) for k, v in vars(a).items()}}
    md = []
    if not a.skip_runs:
        pin = tuple(a.pin.split("/")) if a.pin else None
        results["runs"] = compare_runs(out, a.base or base_model(out, a.sft_steps), a.iterations, stamp, tuple(a.set),
                                       pin)
        md += ["## Stage by stage", "", runs_table(results["runs"]), ""]
        (out / "results.json").write_text(json.dumps(results, indent=1, default=float))
    if not a.skip_sweep:
        rows = [r for size in a.sizes.split(",") for r in sweep_size(out, *map(int, size.split("x")), a.repeats, stamp)]
        results["transfer"], results["fits"] = rows, fits(rows)
        md += ["## Weight transfer through the store against model size", "", sweep_table(rows, results["fits"]), ""]
    if a.trainer:
        results["trainer"] = compare_trainer(out, base_model(out, a.sft_steps), a.iterations, stamp)
        md += ["## The trainer in-process and as a service", "", trainer_table(results["trainer"]), ""]
    results["load_average_at_end"], results["wall_s"] = os.getloadavg(), round(time.perf_counter() - start, 1)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=float))
    (out / "tables.md").write_text("\n".join(md))
    print("\n".join(md))
    print(f"[bench] {results['wall_s']:.0f} s; wrote {out / 'results.json'} and {out / 'tables.md'}")


if __name__ == "__main__":
    main()
