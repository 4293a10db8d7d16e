"""rlpipe.eval_suite without an engine: the shipped benchmark files and samples, overrides, prompt rendering,
stop strings, the context check, and run_benchmark's bookkeeping on scripted completions."""

import json

import pytest

from rlpipe.config import ConfigError
from rlpipe.eval_suite import (Benchmark, PreparedBenchmark, benchmark_rows, cut_at_stop, load_suite, render_prompt_text,
                               run_benchmark, suite_context)
from rlpipe.rollout.base import Completion

SHIPPED = ["gsm8k", "math500", "humaneval", "mbpp"]


@pytest.fixture(scope="module")
def pool():
    from rlpipe.rewards.pool import VerifierPool

    p = VerifierPool(workers=2)
    yield p
    p.close()


def test_shipped_samples_validate_and_their_reference_solutions_pass(pool):
    """Each shipped sample row, judged on its own reference solution (stop strings applied, as to a response),
    scores 1: the sample files and their verifiers agree."""
    from rlpipe.rewards.pool import VerifyItem

    for b in load_suite(",".join(SHIPPED)):
        rows, version = benchmark_rows(b)
        assert 3 <= len(rows) <= 5 and len(version) == 64 and b.prompts.endswith(f"{b.name}.sample.jsonl")
        assert b.sampling is not None and b.sampling.k == [1, 5, 10] and b.sampling.n == 10 and b.greedy
        items = [VerifyItem(r["task"], cut_at_stop(r["solution"], b.stop)[0], r["ground_truth"]) for r in rows]
        verdicts = pool.score(items)
        assert [(v.status, v.reward) for v in verdicts] == [("ok", 1.0)] * len(rows), (b.name, verdicts)
        if b.task == "code":  # the plain {"tests": [...]} form of the code verifier
            assert all(json.loads(r["ground_truth"])["tests"][0].startswith("assert ") for r in rows)


def test_overrides_are_validated_like_the_file(tmp_path):
    (b,) = load_suite(["gsm8k"], ["gsm8k.sampling.n=4", "gsm8k.sampling.k=[1,2,4]", "gsm8k.max_new_tokens=16"])
    assert (b.sampling.n, b.sampling.k, b.max_new_tokens) == (4, [1, 2, 4], 16)
    with pytest.raises(ConfigError, match=r"sampling.k: k=\[10\] with n=4"):
        load_suite("gsm8k", ["gsm8k.sampling.n=4", "gsm8k.sampling.k=[1,10]"])
    with pytest.raises(ConfigError, match="'mbpp' is not in the suite"):
        load_suite("gsm8k", ["mbpp.max_new_tokens=8"])
    with pytest.raises(ConfigError, match="maxnewtokens: unknown key"):
        load_suite("gsm8k", ["gsm8k.maxnewtokens=8"])
    with pytest.raises(ConfigError, match="no benchmark 'gsm9k'.*known: gsm8k, humaneval, math500, mbpp"):
        load_suite("gsm9k")
    with pytest.raises(ConfigError, match="nothing to measure"):
        load_suite("gsm8k", ["gsm8k.greedy=false", "gsm8k.sampling=null"])
    (b,) = load_suite("gsm8k", [f"gsm8k.prompts={tmp_path / 'none.jsonl'}"])
    with pytest.raises(ValueError, match=r"file not found; import the benchmark .*--suite-set gsm8k.prompts=FILE"):
        benchmark_rows(b)
    (b,) = load_suite("gsm8k", ["gsm8k.split=validation"])
    with pytest.raises(ValueError, match=r"has no 'validation' rows \(its splits: \['test'\]\)"):
        benchmark_rows(b)


def test_a_bad_row_is_an_error_naming_it(tmp_path):
    rows = [{"id": "a", "prompt": "1+1=", "task": "math", "ground_truth": "2", "split": "test"},
            {"id": "b", "prompt": "2+2=", "task": "math", "ground_truth": None, "split": "test"}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "mine.yaml").write_text("prompts: p.jsonl\nmax_new_tokens: 4\n")  # relative to the file
    (b,) = load_suite([str(tmp_path / "mine.yaml")])
    assert b.name == "mine" and b.prompts == str(tmp_path / "p.jsonl")
    with pytest.raises(ValueError, match="row b: ground_truth: no ground truth"):
        benchmark_rows(b)
    (b,) = load_suite([str(tmp_path / "mine.yaml")], ["mine.limit=1"])
    assert [r["id"] for r in benchmark_rows(b)[0]] == ["a"]


def test_render_prompt_text():
    row = {"prompt": "What is 2+2?", "chat": False}
    boxed = Benchmark(name="x", prompts="p", template="{prompt}\nAnswer in \\boxed{}.")
    assert render_prompt_text(boxed, row, chat_template=False) == ("What is 2+2?\nAnswer in \\boxed{}.", False)
    text, chat = render_prompt_text(boxed, row, chat_template=True)  # auto: the tokenizer has a template
    assert chat and json.loads(text) == [{"role": "user", "content": "What is 2+2?\nAnswer in \\boxed{}."}]
    sys_plain = Benchmark(name="x", prompts="p", system_prompt="Be brief.", chat=False)
    assert render_prompt_text(sys_plain, row, chat_template=True) == ("Be brief.\n\nWhat is 2+2?", False)
    sys_chat = Benchmark(name="x", prompts="p", system_prompt="Be brief.", template="Q: {prompt}")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes?"}, {"role": "user", "content": "2+2"}]
    text, chat = render_prompt_text(sys_chat, {"prompt": json.dumps(msgs), "chat": True}, chat_template=False)
    assert chat and json.loads(text) == [{"role": "system", "content": "Be brief."}] + msgs[:2] + [{"role": "user", "content": "Q: 2+2"}]


def test_cut_at_stop_and_the_context_check():
    assert cut_at_stop("    return 1\ndef g():\n    pass\nprint(1)", ["\nprint(", "\ndef "]) == ("    return 1", True)
    assert cut_at_stop("    return 1", ["\ndef "]) == ("    return 1", False)
    b = Benchmark(name="long", prompts="p", max_new_tokens=100)
    prepared = [PreparedBenchmark(b, [{}], [[1] * 200], "v")]
    assert suite_context(prepared, own=None) == 300 and suite_context(prepared, own=300) == 300
    with pytest.raises(ValueError, match="context is 256 tokens .* long needs 300 .*max_new_tokens"):
        suite_context(prepared, own=256)


class ScriptedEngine:
    """Completions given in advance per (temperature == 0, prompt index)."""

    def __init__(self, greedy, sampled):
        self.script, self.calls = {True: greedy, False: sampled}, []

    def generate(self, prompts, sampling):
        self.calls.append(sampling)
        out = self.script[sampling.temperature == 0.0]
        assert all(len(per) == sampling.n for per in out)
        return out


def _c(text, n_tokens, reason="stop"):
    return Completion(list(range(n_tokens)), [0.0] * n_tokens, text, reason)


def test_run_benchmark_judges_every_response(pool):
    """Two problems; stop strings cut before judging, a length stop that a stop string cut is not truncated, and
    per-problem verdicts match the metrics."""
    rows = [{"id": "p1", "prompt": "1+1=", "task": "exact", "ground_truth": "2", "tests": None},
            {"id": "p2", "prompt": "2+2=", "task": "exact", "ground_truth": "4", "tests": None}]
    b = Benchmark(name="t", prompts="p", max_new_tokens=6, stop=["\n"],
                  sampling={"n": 3, "temperature": 1.0, "top_p": 1.0, "k": [1, 3]})
    engine = ScriptedEngine(greedy=[[_c("2", 1)], [_c("5\nxx", 6, "length")]],
                            sampled=[[_c("2", 1), _c("3", 1), _c("22222", 6, "length")], [_c("4\n4", 6, "length"), _c("1", 2), _c("9", 2)]])
    res = run_benchmark(engine, pool, PreparedBenchmark(b, rows, [[1], [2]], "v"))
    m = res["metrics"]
    assert [s.n for s in engine.calls] == [1, 3] and engine.calls[1].seed == 0 and engine.calls[0].temperature == 0.0
    assert m["greedy_acc"] == 0.5 and m["pass_at_1"] == pytest.approx((1 / 3 + 1 / 3) / 2) and m["pass_at_3"] == 1.0
    assert m["mean_len"] == pytest.approx((1 + 6 + 1 + 1 + 6 + 6 + 2 + 2) / 8) and m["truncated"] == pytest.approx(1 / 8)
    assert res["problems"][1] == {"id": "p2", "greedy": ["ok", 0.0], "samples": [["ok", 1.0], ["ok", 0.0], ["ok", 0.0]]}
    assert [(t["kind"], t["response"], t["truncated"]) for t in res["table"] if t["id"] == "p2"] == [
        ("greedy", "5", False), ("sample 0", "4", False), ("sample 1", "1", False), ("sample 2", "9", False)]
