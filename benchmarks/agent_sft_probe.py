"""How far does SFT on tool-use demonstrations take the tiny policy in the calculator environment?

Builds rlpipe's tiny Qwen2 (3.4M parameters, character tokenizer), trains it by SFT on the
calculator expert's demonstrations (``calc(EXPR)`` then ``answer(N)``, chat template, loss on the
policy's tokens only), then runs greedy episodes on held-out problems on the HF engine and prints
episode success, steps and tool calls — the starting point the agent demo's RL would have.

    .venv/bin/python benchmarks/agent_sft_probe.py --steps 300 --traces 4000 --digits 4
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from rlpipe.config import ModelConfig, SFTConfig
from rlpipe.envs import EnvLimits, EnvSpec
from rlpipe.envs.experts import demonstrate
from rlpipe.envs.metrics import episode_metrics
from rlpipe.rollout.base import SamplingConfig
from rlpipe.rollout.multiturn import encode_episode, run_episodes
from rlpipe.training.sft import episode_example, train_sft_examples
from rlpipe.training.tiny import build_char_tokenizer, build_tiny_model

HELD_OUT_SEED = 1_000_000  # held-out problems are drawn from seeds no training trace uses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--traces", type=int, default=4000)
    ap.add_argument("--digits", type=int, default=4)
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    spec = EnvSpec(env="calculator", params={"digits": args.digits}, limits=EnvLimits(max_steps=4))
    tok = build_char_tokenizer()
    model = build_tiny_model(ModelConfig(), tok, seed=args.seed)
    examples = []
    for s in range(args.traces):
        r = encode_episode(tok, demonstrate(spec, {}, s), chat=True)
        examples.append(episode_example(r.prompt_ids, r.response_ids, r.loss_mask))
    start = time.time()

    def log(step: int, m: dict) -> None:
        if step % 50 == 0:
            eta = (time.time() - start) / step * (args.steps - step)
            print(f"sft {step}/{args.steps}: loss {m['loss_ema']:.3f} (ETA {eta:.0f} s)", flush=True)

    res = train_sft_examples(model, tok, examples, SFTConfig(steps=args.steps, batch_size=64, stop_at_accuracy=None), args.seed, log=log)
    print(f"SFT: {res.steps} steps in {res.wall_s:.0f} s, loss {res.final_loss:.3f}")
    with tempfile.TemporaryDirectory() as d:
        from rlpipe.rollout.hf_engine import HFEngine
        from rlpipe.training.checkpoint import save_checkpoint

        save_checkpoint(d, model, tok)
        engine = HFEngine(d)
        tasks = [({}, HELD_OUT_SEED + k) for k in range(args.eval)]
        for temp in (0.0, 1.0):
            out = run_episodes(engine, tok, spec, tasks, SamplingConfig(temperature=temp, max_new_tokens=24, seed=1), chat=True)
            m = episode_metrics([r.episode for r in out])
            print(f"T={temp:g}: success {m['episode/success_share']:.1%}, steps {m['episode/steps_mean']:.2f}, "
                  f"tool calls/episode {m['episode/tool_calls_per_episode']:.2f}, tool errors {m['episode/tool_error_rate']:.1%}, "
                  f"truncated {m['episode/truncated_share']:.1%}")
        print("sample:", tok.decode(out[0].response_ids))


if __name__ == "__main__":
    main()
