"""The vLLM engine's sampled completions: text, log-probs and seeds (the engine decodes the text itself)."""

import dataclasses
import math
import threading

import pytest

from rlpipe.rollout.base import SamplingConfig
from rlpipe.rollout.engines import get_engine, new_engine
from rlpipe.rollout.vllm_engine import STALL_STEPS, EngineStalled


def test_sampled_completions_carry_their_text_and_their_tokens_logprobs(tiny_checkpoint):
    engine = get_engine("vllm", tiny_checkpoint, max_model_len=64)
    tok = engine.tokenizer
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("12+34=", "7+8=", "99+1=")]
    sampling = SamplingConfig(n=4, temperature=1.0, max_new_tokens=6, seed=3)
    out = engine.generate(prompts, sampling)
    assert [len(g) for g in out] == [4, 4, 4]
    comps = [c for g in out for c in g]
    assert len({tuple(c.token_ids) for c in comps}) > 1  # sampled, not greedy
    for c in comps:
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert len(c.logprobs) == len(c.token_ids) and all(lp <= 0.0 and math.isfinite(lp) for lp in c.logprobs)
    # Each sampled log-prob is the log-prob of the token sampled there (T=1: the engine's own forward pass).
    again = engine.sequence_logprobs([p for p, g in zip(prompts, out) for _ in g], [c.token_ids for c in comps])
    assert max(abs(a - b) for c, lps in zip(comps, again) for a, b in zip(c.logprobs, lps)) < 1e-4
    # The same seed draws the same completions; another seed draws others.
    same = engine.generate(prompts, sampling)
    assert [[c.token_ids for c in g] for g in same] == [[c.token_ids for c in g] for g in out]
    other = engine.generate(prompts, SamplingConfig(n=4, temperature=1.0, max_new_tokens=6, seed=4))
    assert [[c.token_ids for c in g] for g in other] != [[c.token_ids for c in g] for g in out]


def _in_thread(fn, timeout_s: float = 120.0) -> dict:
    """Run ``fn`` where a hang fails the test instead of the suite."""
    box: dict = {}

    def run() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["err"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "the engine is still spinning"
    return box


def _tokens(out) -> list:
    return [[c.token_ids for c in g] for g in out]


@pytest.fixture()
def engine_and_scheduler(tiny_checkpoint):
    engine = get_engine("vllm", tiny_checkpoint, max_model_len=64)
    scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler
    prompts = [engine.tokenizer(p, add_special_tokens=False)["input_ids"] for p in ("12+34=", "7+8=", "99+1=", "5+5=")]
    return engine, scheduler, prompts, SamplingConfig(n=4, temperature=1.0, max_new_tokens=6, seed=11)


def _idle(engine, scheduler) -> bool:
    return not engine.llm.llm_engine.output_processor.request_states and not scheduler.running and not scheduler.waiting


def test_a_call_that_fails_mid_step_leaves_no_request_behind(engine_and_scheduler, monkeypatch):
    engine, scheduler, prompts, sampling = engine_and_scheduler
    want = engine.generate(prompts, sampling)
    real, calls = scheduler.update_from_output, []

    def fails_once(*a, **k):
        calls.append(1)
        if len(calls) == 1:  # after the step was scheduled: its requests hold computed tokens and no output
            raise RuntimeError("injected fault in the middle of a step")
        return real(*a, **k)

    monkeypatch.setattr(scheduler, "update_from_output", fails_once)
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.generate(prompts, sampling)
    assert _idle(engine, scheduler)  # left in the engine, they kept every later generate spinning
    box = _in_thread(lambda: engine.generate(prompts, sampling))
    assert "err" not in box and _tokens(box["out"]) == _tokens(want)


def test_a_stalled_engine_raises_instead_of_spinning(engine_and_scheduler, monkeypatch):
    engine, scheduler, prompts, sampling = engine_and_scheduler
    want = engine.generate(prompts, sampling)
    real, calls = scheduler.update_from_output, []

    def loses_the_first_tokens(scheduler_output, model_output):
        calls.append(1)  # the prefill is computed, its sampled tokens never arrive: the state seen in a hang
        if len(calls) == 1:
            model_output = dataclasses.replace(model_output, sampled_token_ids=[[] for _ in model_output.req_ids],
                                               logprobs=None)
        return real(scheduler_output, model_output)

    monkeypatch.setattr(scheduler, "update_from_output", loses_the_first_tokens)
    box = _in_thread(lambda: engine.generate(prompts, sampling), timeout_s=60)
    assert isinstance(box.get("err"), EngineStalled), box
    assert "16 running request(s)" in str(box["err"]) and "aborted" in str(box["err"])
    assert _idle(engine, scheduler) and len(calls) <= 1 + STALL_STEPS
    monkeypatch.setattr(scheduler, "update_from_output", real)
    assert _tokens(engine.generate(prompts, sampling)) == _tokens(want)


def test_two_threads_take_turns_on_one_engine(engine_and_scheduler):
    """A batch generated ahead runs in a thread of its own while the flow may call the engine too."""
    engine, scheduler, prompts, sampling = engine_and_scheduler
    other = SamplingConfig(n=2, temperature=1.0, max_new_tokens=6, seed=12)
    want = (_tokens(engine.generate(prompts, sampling)), _tokens(engine.generate(prompts[:2], other)))
    for _ in range(3):
        boxes = [{}, {}]
        threads = [threading.Thread(target=lambda b=b, p=p, s=s: b.update(out=_tokens(engine.generate(p, s))))
                   for b, p, s in ((boxes[0], prompts, sampling), (boxes[1], prompts[:2], other))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert (boxes[0].get("out"), boxes[1].get("out")) == want


def test_a_thread_with_another_openmp_count_generates_the_same_batch(engine_and_scheduler):
    """torch's thread count set apart from a new thread's OpenMP default (torch.set_num_threads(1) in a test or a
    user's script), then a batch generated ahead in a thread of its own: vLLM's CPU attention planned the step for 2
    threads and ran it on 1 ("thread_num == thread_num (2 vs. 1)") and the call failed mid-step."""
    import torch

    engine, scheduler, prompts, sampling = engine_and_scheduler
    want = _tokens(engine.generate(prompts, sampling))
    before = torch.get_num_threads()
    torch._C.set_num_threads(1)  # torch.set_num_threads itself is a no-op once vLLM has bound its threads
    try:
        box = _in_thread(lambda: _tokens(engine.generate(prompts, sampling)))
        assert "err" not in box, box.get("err")
        assert box["out"] == want and _tokens(engine.generate(prompts, sampling)) == want
    finally:
        torch._C.set_num_threads(before)


def test_the_engine_logs_to_stderr_and_leaves_stdout_to_results(tiny_checkpoint):
    import os
    import subprocess
    import sys

    code = "\n".join([
        "import sys",
        "from rlpipe.rollout.base import SamplingConfig",
        "from rlpipe.rollout.vllm_engine import VLLMEngine",
        "VLLMEngine(sys.argv[1], max_model_len=64).generate([[5, 6, 7]], SamplingConfig(n=1, max_new_tokens=2))",
        "print('RESULT')",
    ])
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_STREAM"}
    proc = subprocess.run([sys.executable, "-c", code, str(tiny_checkpoint)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines() == ["RESULT"]  # no vLLM line before or after it
    assert "INFO" in proc.stderr and "vllm" in proc.stderr.lower()  # vLLM's own log lines, on stderr


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def test_a_closed_engine_gives_its_memory_back_and_the_others_keep_working(tiny_checkpoint):
    """vLLM freezes its start's objects out of the collector's reach, and its own shutdown tears down the parallel
    state every engine of the process uses: close() must free the one without breaking the other."""
    kept = get_engine("vllm", tiny_checkpoint, max_model_len=64)
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=4, seed=5)
    before = kept.generate([[5, 6, 7]], sampling)
    for _ in range(2):  # a second round: nothing left behind by the first adds up
        start = _rss()
        extra = new_engine("vllm", tiny_checkpoint, max_model_len=64)
        held = _rss() - start
        kv = extra.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes
        # the engine's KV cache (and its weights) are resident: 90% of it, since the allocator may hand the new engine
        # pages the last one freed and the process still holds (a fresh clone's second round: 99.7% of the cache)
        assert held > 0.9 * kv
        extra.close()
        assert _rss() - start < 0.25 * held, f"{(_rss() - start) >> 20} MiB of {held >> 20} MiB still held"
    assert kept.generate([[5, 6, 7]], sampling)[0][0].token_ids == before[0][0].token_ids
