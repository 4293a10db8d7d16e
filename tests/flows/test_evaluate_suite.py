"""The evaluate-suite flow end to end on the tiny model: shipped sample benchmarks and one whose references are the
model's own greedy answers (so its greedy accuracy is known: 1.0), greedy + 4 samples, logged to MLflow.

pass@k is checked against the per-sample verdicts the flow returns, counted here independently."""

import json
import math
import shutil

import pytest

from rlpipe.config import RunConfig, settings
from rlpipe.tracking.mlflow_utils import Tracker
from tests.flows.test_evaluate_flow import own_answers_task, registered, untrained_checkpoint  # noqa: F401 - fixtures

N, KS, OWN_ROWS = 4, [1, 2, 4], 12
CFG = RunConfig.model_validate({"rollout": {"engine": "hf"}, "reward": {"workers": 2}})
SAMPLES = [f"{b}.{k}" for b in ("gsm8k", "mbpp") for k in ("max_new_tokens=8", f"sampling.n={N}", "sampling.k=[1,2,4]")]


@pytest.fixture(scope="module")
def long_context(tiny_checkpoint, tmp_path_factory):
    """A copy of the tiny model declaring a 1,024-token context, so the shipped samples' long prompts fit its
    context check (rotary positions: nothing in the weights changes; its answers to them are noise either way)."""
    folder = tmp_path_factory.mktemp("tiny-1k") / "model"
    shutil.copytree(tiny_checkpoint, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": 1024}))
    return folder


@pytest.fixture(scope="module")
def own_bench(tiny_checkpoint, tmp_path_factory):
    """A benchmark file over arithmetic prompts whose references are the tiny model's greedy answers (``exact``)."""
    folder = tmp_path_factory.mktemp("own-bench")
    own_answers_task(folder / "own.jsonl", tiny_checkpoint)
    (folder / "own.yaml").write_text(
        f"prompts: own.jsonl\nsplit: test\nlimit: {OWN_ROWS}\nmax_new_tokens: 6\nchat: false\ngreedy: true\n"
        f"sampling: {{n: {N}, temperature: 1.0, top_p: 1.0, k: {KS}}}\n")
    return folder / "own.yaml"


def _check_consistent(bench: dict, n: int, ks: list[int]) -> list[int]:
    """The flow's metrics recomputed from its per-problem verdicts; returns the correct-sample counts."""
    m, problems = bench["metrics"], bench["problems"]
    right = [[s == "ok" and r == 1.0 for s, r in p["samples"]] for p in problems]
    assert all(len(r) == n for r in right) and m["n"] == len(problems)
    assert m["greedy_acc"] == pytest.approx(sum(p["greedy"] == ["ok", 1.0] for p in problems) / len(problems))
    # pass@1 is the mean per-sample accuracy; pass@n is the share of problems with any correct sample.
    assert m["pass_at_1"] == pytest.approx(sum(map(sum, right)) / (n * len(problems)), abs=1e-12)
    assert m[f"pass_at_{n}"] == pytest.approx(sum(map(any, right)) / len(problems), abs=1e-12)
    for k in ks:
        exact = sum(1 - math.comb(n - sum(r), k) / math.comb(n, k) for r in right) / len(problems)
        assert m[f"pass_at_{k}"] == pytest.approx(exact, abs=1e-12)
    statuses = sum(m[key] for key in m if key.startswith("n_"))
    assert statuses == len(problems) * (1 + n) and 0 <= m["truncated"] <= 1
    return [sum(r) for r in right]


def test_suite_end_to_end(prefect_harness, long_context, own_bench):
    from flows.evaluate import evaluate_suite

    out = evaluate_suite(model=str(long_context), suite=["gsm8k", "mbpp", str(own_bench)], overrides=SAMPLES,
                         experiment="suite-e2e", config=CFG)
    assert out["suite"] == ["gsm8k", "mbpp", "own"] and out["version"] is None
    own = out["benchmarks"]["own"]
    counts = _check_consistent(own, N, KS)
    assert own["metrics"]["greedy_acc"] == 1.0  # its references are its own greedy answers
    assert 0 < sum(counts) < N * OWN_ROWS, counts  # temperature 1: some samples differ from the greedy answer
    assert own["metrics"]["mean_len"] <= 6
    for name in ("gsm8k", "mbpp"):
        _check_consistent(out["benchmarks"][name], N, [1, 2, 4])
        assert out["benchmarks"][name]["metrics"]["mean_len"] <= 8 and len(out["benchmarks"][name]["problems"]) == 3
    # MLflow: one run, <bench>/<metric> for each, the same numbers, the model named in its tags.
    tracker = Tracker(settings(), CFG)
    run = tracker.client.get_run(out["mlflow_run_id"])
    for name, bench in out["benchmarks"].items():
        for key in ("greedy_acc", "pass_at_1", "pass_at_2", "pass_at_4", "mean_len", "truncated", "n_ok", "n_error"):
            assert run.data.metrics[f"{name}/{key}"] == pytest.approx(bench["metrics"][key]), (name, key)
        assert run.data.tags[f"rlpipe.eval.{name}.dataset_version"] == bench["dataset_version"]
    assert run.data.tags["rlpipe.eval.model_name"] == str(long_context) and run.data.tags["rlpipe.kind"] == "evaluate-suite"
    assert run.data.tags["rlpipe.eval.weights_sha256"] == out["weights_sha256"] and run.info.status == "FINISHED"
    assert tracker.client.get_experiment(run.info.experiment_id).name == "suite-e2e"
    assert {a.path for a in tracker.client.list_artifacts(run.info.run_id, "evals")} == {f"evals/{b}.json" for b in out["suite"]}


def test_versions_line_up_in_one_experiment(prefect_harness, registered, own_bench):  # noqa: F811
    """Two registered versions: two runs in the experiment, the same metric names, each tagged with its version."""
    from flows.evaluate import evaluate_suite

    cfg, versions = registered
    name = cfg.registered_model
    outs = [evaluate_suite(model=f"models:/{name}/{v.version}", suite=[str(own_bench)], experiment="suite-compare",
                           overrides=["own.sampling=null"]) for v in versions]
    tracker = Tracker(settings(), cfg)
    exp = tracker.client.get_experiment_by_name("suite-compare")
    runs = tracker.client.search_runs([exp.experiment_id])
    assert {r.info.run_id for r in runs} == {o["mlflow_run_id"] for o in outs}
    assert {(r.data.tags["rlpipe.eval.model_name"], r.data.tags["rlpipe.eval.model_version"]) for r in runs} == {
        (name, v.version) for v in versions}
    assert len({frozenset(r.data.metrics) for r in runs}) == 1 and "own/greedy_acc" in runs[0].data.metrics
    by_version = {r.data.tags["rlpipe.eval.model_version"]: r.data.metrics["own/greedy_acc"] for r in runs}
    assert by_version[versions[0].version] == 1.0 and by_version[versions[1].version] < 1.0  # v1 is the tiny model
    assert tracker.client.get_model_version(name, versions[0].version).tags["eval_suite_run"] == outs[0]["mlflow_run_id"]


def test_cli_suite(prefect_harness, tiny_checkpoint, own_bench):
    from typer.testing import CliRunner

    from rlpipe.cli import app

    res = CliRunner().invoke(app, ["evaluate", str(tiny_checkpoint), "--suite", str(own_bench), "--suite-set", "own.sampling.n=2",
                                   "--suite-set", "own.sampling.k=[1,2]", "--set", "rollout.engine=hf", "--experiment", "suite-cli"])
    assert res.exit_code == 0, res.output
    assert "own: greedy 1.000, pass@1 " in res.output and "pass@2" in res.output and "(n=12)" in res.output
    summary = json.loads(open(res.stdout.strip().splitlines()[-1]).read())
    assert summary["kind"] == "evaluate-suite" and summary["experiment"] == "suite-cli"
    bad = CliRunner().invoke(app, ["evaluate", str(tiny_checkpoint), "--suite", str(own_bench), "--suite-set", "gsm8k.limit=1"])
    assert bad.exit_code == 2 and "'gsm8k' is not in the suite (own)" in bad.output
    bad = CliRunner().invoke(app, ["evaluate", str(tiny_checkpoint), "--suite", "gsm8k", "--promote-to", "best"])
    assert bad.exit_code == 2 and "--suite reports only" in bad.output
