"""What vLLM's own detokenizing costs a generate at the demo size (why rlpipe's engine decodes the text itself).

    .venv/bin/python benchmarks/vllm_detokenize.py --repeats 8

The untrained demo-size model (3.4M parameters, built from config), in-process vLLM with rlpipe's CPU
settings, 32 arithmetic prompts x 8 samples, <=8 new tokens, T=1, sampled log-probs on, per-request seeds.
Three variants, alternating, each `--repeats` times after a warm-up:
  vllm_text:  vLLM detokenizes (incrementally, every step, and every log-prob's token) — rlpipe before;
  batch_decode: detokenize=False, the text from one tokenizer.batch_decode — rlpipe now;
  batch_decode_flat: the same with flat_logprobs=True (fewer Python objects per token) — rlpipe now.
Checks that all three give the same texts and log-probs, and prints the median seconds per generate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("/tmp/rlpipe-bench/vllm_detokenize.json"))
    a = ap.parse_args()
    from profile_update import untrained_policy
    from rlpipe.config import RunConfig
    from rlpipe.data import build_arithmetic
    from rlpipe.rollout.vllm_engine import VLLMEngine
    from rlpipe.tokens import render_prompt
    from vllm import SamplingParams

    cfg = RunConfig()
    engine = VLLMEngine(untrained_policy(cfg), max_model_len=64)
    tok = engine.tokenizer
    rows = [r for r in build_arithmetic(cfg.data).to_pylist() if r["split"] == "train"][:32]
    prompts = [{"prompt_token_ids": tok(render_prompt(tok, r["prompt"], r["chat"]), add_special_tokens=False)["input_ids"]}
               for r in rows]

    def run(variant: str, seed: int) -> tuple[float, list]:
        params = [SamplingParams(n=8, temperature=1.0, max_tokens=8, logprobs=0, seed=seed + i, skip_special_tokens=True,
                                 detokenize=variant == "vllm_text", flat_logprobs=variant.endswith("flat"))
                  for i in range(len(prompts))]
        start = time.perf_counter()
        outs = [o for out in engine.llm.generate(prompts, params, use_tqdm=False) for o in out.outputs]
        ids = [list(o.token_ids) for o in outs]
        texts = [o.text for o in outs] if variant == "vllm_text" else tok.batch_decode(ids, skip_special_tokens=True)
        lps = [[float(step[t].logprob) for step, t in zip(o.logprobs, i)] for o, i in zip(outs, ids)]
        return time.perf_counter() - start, [texts, lps]

    variants = ("vllm_text", "batch_decode", "batch_decode_flat")
    run("vllm_text", 0)  # warm-up
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(a.repeats):
        results = {}
        for v in variants:
            dt, results[v] = run(v, 1000 * (r + 1))
            seconds[v].append(dt)
        assert results["vllm_text"] == results["batch_decode"] == results["batch_decode_flat"], "texts or log-probs differ"
    summary = {v: {"median_s": round(statistics.median(s), 4), "runs_s": [round(x, 3) for x in s]} for v, s in seconds.items()}
    print(json.dumps(summary, indent=1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
