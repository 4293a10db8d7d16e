"""Run TRL's GRPOTrainer on rlpipe's tiny arithmetic model, for a side-by-side with rlpipe's GRPO loop.

Run with the TRL venv (see benchmarks/setup_trl_venv.sh), not the project venv:

    ~/.cache/rlpipe/bench-trl/bin/python benchmarks/trl_grpo.py \
        --model "$(ls -d /tmp/rh/store/runs/sft-*/checkpoints/sft | head -1)" \
        --data /tmp/rlpipe-bench/arith.jsonl --samples 8192 --out /tmp/rlpipe-bench/trl.json

The data file comes from benchmarks/export_arith.py (project venv). Settings mirror rlpipe's demo
GRPO: 32 prompts x 8 samples = 256 completions per iteration (one generation batch), 64 completions
per optimizer step (4 steps per iteration, old log-probs taken once per iteration), temperature 1,
top_p 1, at most 8 new tokens, no KL, AdamW lr 3e-5 constant with betas (0.9, 0.99) and no weight
decay, gradient-norm clip 1.0, PPO clip 0.2, token-mean loss over each 64-completion step, fp32,
seed 0, HF generate (no vLLM). "Samples" everywhere means completions.

The batch options (--prompts-per-iter, --num-generations, --completions-per-step, --eval-size) are
grpo_loop.py's too; benchmarks/run_sizes.sh gives both the same ones at ~30M and ~110M parameters.

Output JSON: seconds per 256 completions (and per completion), total wall time, greedy held-out accuracy on the test
split before and after training, completions used, and the per-iteration training reward.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model folder (save_pretrained output, with tokenizer)")
    ap.add_argument("--data", required=True, help="JSONL from benchmarks/export_arith.py")
    ap.add_argument("--samples", type=int, default=8192, help="completion budget; rounded down to whole iterations")
    ap.add_argument("--out", required=True, help="JSON result file")
    ap.add_argument("--prompts-per-iter", type=int, default=32)
    ap.add_argument("--num-generations", type=int, default=8, help="samples per prompt (GRPO group size)")
    ap.add_argument("--completions-per-step", type=int, default=64, help="completions per optimizer step")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--beta", type=float, default=0.0, help="KL coefficient")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument(
        "--loss-type",
        default="bnpo",
        help="TRL loss aggregation; 'bnpo' = token mean over each optimizer step's completions, as rlpipe does "
        "(TRL's own default is 'dapo', which divides by the mean token count of the 256-completion batch)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--eval-batch", type=int, default=500, help="prompts per greedy evaluation batch")
    ap.add_argument("--eval-size", type=int, default=None, help="evaluate on the first N test prompts (default: all)")
    ap.add_argument("--skip-eval", action="store_true", help="skip both evaluations (timing only)")
    ap.add_argument("--workdir", default=None, help="Trainer output_dir (nothing is saved; default: a temp dir)")
    return ap.parse_args(argv)


ARGS = _parse_args() if __name__ == "__main__" else None

# Thread limits must be in place before torch (and its OpenMP runtime) is imported.
if ARGS is not None:
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(ARGS.threads)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402


def log(msg: str) -> None:
    print(f"[trl-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_rows(path: str | Path) -> dict[str, list[dict]]:
    by_split: dict[str, list[dict]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                by_split.setdefault(row["split"], []).append(row)
    for need in ("train", "test"):
        if not by_split.get(need):
            raise SystemExit(f"{path} has no '{need}' rows; re-run benchmarks/export_arith.py")
    return by_split


def eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.insert(0, tokenizer.eos_token_id)
    return ids


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int, batch_size: int) -> dict:
    """Exact match of the greedy completion (special tokens skipped, stripped) against ground_truth."""
    was_training = model.training
    model.eval()
    gen_cfg = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_ids(model, tokenizer),
        pad_token_id=tokenizer.pad_token_id,
    )
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    correct = 0
    t0 = time.perf_counter()
    try:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            enc = tokenizer([r["prompt"] for r in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, generation_config=gen_cfg)
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            correct += sum(t.strip() == r["ground_truth"] for t, r in zip(texts, chunk))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return {"accuracy": correct / len(rows), "correct": correct, "n": len(rows), "seconds": time.perf_counter() - t0}


def make_reward(tokenizer, stop_ids: list[int]):
    stop = set(stop_ids)

    def exact_answer(prompts, completions, completion_ids, ground_truth, **_):
        rewards = []
        for ids, answer in zip(completion_ids, ground_truth):
            ids = list(ids)
            cut = next((i for i, t in enumerate(ids) if t in stop), len(ids))
            text = tokenizer.decode(ids[:cut], skip_special_tokens=True).strip()
            rewards.append(1.0 if text == answer else 0.0)
        return rewards

    return exact_answer


class IterationTimer(TrainerCallback):
    """Wall time per generation batch of completions (= one rlpipe iteration: generate, score, 4 steps)."""

    def __init__(self, steps_per_iter: int, completions_per_iter: int, total_iters: int):
        self.steps_per_iter = steps_per_iter
        self.completions_per_iter = completions_per_iter
        self.total_iters = total_iters
        self.iter_seconds: list[float] = []
        self.iter_cpu_s: list[float] = []  # this process's CPU-seconds (all threads; TRL starts no children here)
        self._t = self._cpu = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self._t, self._cpu = time.perf_counter(), time.process_time()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.steps_per_iter:
            return
        now, cpu = time.perf_counter(), time.process_time()
        self.iter_seconds.append(now - self._t)
        self.iter_cpu_s.append(cpu - self._cpu)
        self._t, self._cpu = now, cpu


class RewardRecorder(TrainerCallback):
    """Collects TRL's logged metrics (logging_steps = steps per iteration → one record per iteration)."""

    def __init__(self, timer: IterationTimer):
        self.timer = timer
        self.records: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "reward" not in logs:
            return
        it = len(self.records) + 1
        rec = {
            "iteration": it,
            "step": state.global_step,
            "reward": logs.get("reward"),
            "loss": logs.get("loss"),
            "grad_norm": logs.get("grad_norm"),
            "completion_len": logs.get("completions/mean_length"),
            "clipped_ratio": logs.get("completions/clipped_ratio"),
            "seconds": self.timer.iter_seconds[-1] if self.timer.iter_seconds else None,
        }
        self.records.append(rec)
        secs = f"{rec['seconds']:.1f}s" if rec["seconds"] is not None else "?"
        log(
            f"iter {it}/{self.timer.total_iters} step {state.global_step}: reward {rec['reward']:.3f} "
            f"len {rec['completion_len']} loss {rec['loss']} grad_norm {rec['grad_norm']} "
            f"time {secs} per {self.timer.completions_per_iter} completions"
        )


class StageTimer:
    """Wall seconds inside GRPOTrainer's own methods (wrapped on the class, so TRL runs unchanged):
    HF generation, generation + scoring + the log-prob pass before the first step, and whole training steps
    (the first step of an iteration contains that iteration's generation)."""

    METHODS = ("_generate", "_generate_and_score_completions", "training_step")

    def __init__(self, cls: type):
        self.seconds = dict.fromkeys(self.METHODS, 0.0)
        for name in self.METHODS:
            setattr(cls, name, self._timed(name, getattr(cls, name)))

    def _timed(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return timed

    def per_iteration(self, iterations: int) -> dict[str, float]:
        s = {k: v / max(iterations, 1) for k, v in self.seconds.items()}
        return {"generate_s": s["_generate"],
                "score_and_logprob_pass_s": s["_generate_and_score_completions"] - s["_generate"],
                "optimizer_steps_s": s["training_step"] - s["_generate_and_score_completions"]}


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    wall0 = time.perf_counter()

    per_iter = args.prompts_per_iter * args.num_generations
    if per_iter % args.completions_per_step:
        raise SystemExit(f"completions per iteration ({per_iter}) must be a multiple of --completions-per-step")
    if args.completions_per_step % args.num_generations:
        raise SystemExit("--completions-per-step must hold whole prompt groups (a multiple of --num-generations)")
    steps_per_iter = per_iter // args.completions_per_step
    iters = args.samples // per_iter
    if iters < 1:
        raise SystemExit(f"--samples {args.samples} is below one iteration ({per_iter} completions)")
    if iters * per_iter != args.samples:
        log(f"--samples {args.samples} rounded down to {iters * per_iter} (whole iterations of {per_iter})")

    data = load_rows(args.data)
    test_rows = data["test"][: args.eval_size] if args.eval_size else data["test"]
    train_ds = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in data["train"]])
    log(
        f"torch {torch.__version__} transformers {transformers.__version__} trl {trl.__version__}; "
        f"threads {torch.get_num_threads()}; train {len(train_ds)} test {len(test_rows)} prompts"
    )

    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left", truncation_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    log(f"model {args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, eos ids {eos_ids(model, tokenizer)}")

    before = None
    if not args.skip_eval:
        before = greedy_accuracy(model, tokenizer, test_rows, args.max_new_tokens, args.eval_batch)
        log(f"held-out greedy accuracy before: {before['accuracy']:.4f} ({before['correct']}/{before['n']}, {before['seconds']:.1f}s)")

    workdir = args.workdir or tempfile.mkdtemp(prefix="trl-grpo-bench-")
    config = GRPOConfig(
        output_dir=workdir,
        seed=args.seed,
        data_seed=args.seed,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        # 64 completions per optimizer step, 4 steps consume one generation batch of 256
        per_device_train_batch_size=args.completions_per_step,
        gradient_accumulation_steps=1,
        steps_per_generation=steps_per_iter,
        num_generations=args.num_generations,
        num_iterations=1,
        max_steps=iters * steps_per_iter,
        # generation (HF generate; TRL's sampling path)
        use_vllm=False,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=0,
        # objective
        beta=args.beta,
        epsilon=0.2,
        loss_type=args.loss_type,
        scale_rewards="group",
        mask_truncated_completions=False,
        # optimizer: AdamW, constant lr, no warm-up (rlpipe: betas (0.9, 0.99), no weight decay, clip 1.0)
        optim="adamw_torch_fused",  # transformers' default on torch >= 2.8, as rlpipe (fused AdamW)
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        # bookkeeping: one log record per iteration, nothing saved or reported
        logging_steps=steps_per_iter,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        shuffle_dataset=True,
    )

    timer = IterationTimer(steps_per_iter, per_iter, iters)
    recorder = RewardRecorder(timer)
    stages = StageTimer(GRPOTrainer)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=make_reward(tokenizer, eos_ids(model, tokenizer)),
        args=config,
        train_dataset=train_ds,
        processing_class=tokenizer,
        callbacks=[timer, recorder],
    )
    log(
        f"GRPO: {iters} iterations x {per_iter} completions ({args.prompts_per_iter} prompts x {args.num_generations}), "
        f"{steps_per_iter} optimizer steps of {args.completions_per_step} per iteration, lr {args.lr}, beta {args.beta}, "
        f"loss {args.loss_type}"
    )
    t_train = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - t_train
    model = trainer.model

    after = None
    if not args.skip_eval:
        after = greedy_accuracy(model, tokenizer, test_rows, args.max_new_tokens, args.eval_batch)
        log(f"held-out greedy accuracy after: {after['accuracy']:.4f} ({after['correct']}/{after['n']}, {after['seconds']:.1f}s)")

    secs = timer.iter_seconds
    steady = secs[1:] if len(secs) > 1 else secs
    result = {
        "framework": "trl",
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "model": str(args.model),
        "data": str(args.data),
        "threads": torch.get_num_threads(),
        "completions_budget": args.samples,
        "completions_used": len(secs) * per_iter,
        "iterations": len(secs),
        "optimizer_steps": trainer.state.global_step,
        "seconds_per_256_completions": (sum(secs) / len(secs)) * 256 / per_iter if secs else None,
        "seconds_per_256_completions_excl_first": (sum(steady) / len(steady)) * 256 / per_iter if steady else None,
        "seconds_per_completion_excl_first": (sum(steady) / len(steady)) / per_iter if steady else None,
        "iteration_seconds": secs,
        "cpu_s_per_iteration": (sum(timer.iter_cpu_s[1:]) / len(timer.iter_cpu_s[1:])) if len(timer.iter_cpu_s) > 1 else None,
        "train_seconds": train_seconds,
        "stage_seconds_per_iteration": stages.per_iteration(len(secs)),
        "total_wall_seconds": time.perf_counter() - wall0,
        "accuracy_before": before["accuracy"] if before else None,
        "accuracy_after": after["accuracy"] if after else None,
        "eval_before": before,
        "eval_after": after,
        "iterations_log": recorder.records,
        "settings": {
            "prompts_per_iteration": args.prompts_per_iter,
            "num_generations": args.num_generations,
            "completions_per_iteration": per_iter,
            "completions_per_optimizer_step": args.completions_per_step,
            "optimizer_steps_per_iteration": steps_per_iter,
            "max_completion_length": args.max_new_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "beta": args.beta,
            "learning_rate": args.lr,
            "lr_schedule": "constant, no warm-up",
            "optimizer": "AdamW (torch fused) betas (0.9, 0.99), weight_decay 0",
            "max_grad_norm": 1.0,
            "epsilon": 0.2,
            "loss_type": args.loss_type,
            "scale_rewards": "group",
            "dtype": "float32",
            "generation": "HF generate (use_vllm=False)",
            "seed": args.seed,
            "eval": f"greedy, left padding, max {args.max_new_tokens} new tokens, exact match on test split",
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    sp = result["seconds_per_256_completions"]
    log(
        f"done: {result['completions_used']} completions, {sp:.2f}s per 256 completions, "
        f"total {result['total_wall_seconds']:.1f}s; accuracy {result['accuracy_before']} -> {result['accuracy_after']}; "
        f"wrote {out}"
    )


if __name__ == "__main__":
    main(ARGS)
    sys.exit(0)
