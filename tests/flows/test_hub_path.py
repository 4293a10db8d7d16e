"""The whole path on hub-style stand-ins of two families (rlpipe.training.standin): SFT on chat messages →
GRPO on vLLM with a reference → PPO on the HF engine → a resume after a kill → the registered versions.

Each checkpoint brings its own tokenizer, chat template (with Chinese prompts in the data), EOS (an int for
qwen2, a list for llama) and 16-bit weights; the first real checkpoint tried failed RL on both engines."""

import json
import random

import pytest
from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.config import load_config, settings
from rlpipe.storage import TRAJECTORY_SCHEMA, open_store
from rlpipe.storage.layout import stage_prefix
from rlpipe.tokens import load_tokenizer
from rlpipe.history import read_history
from rlpipe.tracking.mlflow_utils import Tracker
from tests.flows.test_train_flow import _cli


@pytest.fixture(scope="module", autouse=True)
def _engines_closed():
    """The runs here start engines of two architectures the rest of the suite never uses: close them after the
    module (each vLLM engine holds a 1 GiB KV cache for as long as the process keeps it)."""
    yield
    from rlpipe.rollout.engines import close_engines

    close_engines()


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    """Addition as chat messages in TRL's conversational form; every third question in Chinese."""
    rng, rows, seen = random.Random(0), [], set()
    while len(rows) < 240:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        q = f"{a}+{b}=" if len(rows) % 3 else f"计算 {a}+{b}"
        if q in seen:
            continue
        seen.add(q)
        rows.append({"id": f"c{len(rows)}", "messages": [
            {"role": "system", "content": "Answer with the number only."}, {"role": "user", "content": q},
            {"role": "assistant", "content": str(a + b)}], "ground_truth": str(a + b), "task": "math",
            "split": "train" if len(rows) < 216 else "test"})
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows))
    return path


def _invoke(args):
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output[-4000:]
    return json.loads(open(res.stdout.strip().splitlines()[-1]).read())


def _sets(arch, data, *extra):
    base = [f"task.dataset={data}", f"task.name=hub-{arch}", f"tracking.experiment=hub-{arch}", "rollout.batch_size=4",
            "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6", "train.batch_size=16", "train.micro_batch_size=8",
            "train.save_interval=1", "train.eval_interval=2", "train.eval_size=8", "reward.workers=1", *extra]
    return [x for s in base for x in ("--set", s)]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_sft_grpo_ppo_on_both_engines_and_register(prefect_harness, standins, chat_data, arch):
    # The Llama stand-in's SFT on two DeepSpeed ranks (`--nproc 2`), packed; the Qwen2 one's in the flow's process.
    ranks = ["--nproc", "2", "--set", "sft.pack_sequences=true"] if arch == "llama" else []
    sft = _invoke(["sft", "configs/sft-arithmetic.yaml", *ranks, *_sets(arch, chat_data, f"task.policy_model={standins[arch]}",
                   "sft.steps=20", "sft.batch_size=16", "sft.eval_every=20", "sft.stop_at_accuracy=null")])
    assert sft["sft_steps"] == 20
    base = f"models:/{sft['registered_model']['name']}@base"
    # Qwen2: LoRA, whose syncs move only the adapter into vLLM (rollout.lora_sync: adapter); one iteration, then the
    # run extended to two: the resume starts the engine from the base and puts the save point's adapter on it,
    # and the start probe proves that policy (a double-applied adapter would fail it).
    lora = ["train.lora={r: 8}"] if arch == "qwen2" else []
    grpo_sets = ["run", "configs/grpo-arithmetic.yaml", "--run-id", f"hub-grpo-{arch}", *_sets(
        arch, chat_data, f"task.policy_model={base}", "rollout.engine=vllm", "train.kl_coef=0.01", *lora)]
    if lora:
        assert _invoke(grpo_sets + ["--set", "train.total_iterations=1"])["iterations_done"] == 1
    grpo = _invoke(grpo_sets + ["--set", "train.total_iterations=2"])
    assert grpo["iterations_done"] == 2 and grpo["engine"] == "vllm"
    history = read_history(settings().run_dir(f"hub-grpo-{arch}"))
    assert [h["iteration"] for h in history] == [0, 1]
    assert all(h["sync/adapter_only"] == float(bool(lora)) and h["sync/probe_max_abs_diff"] < 1e-3 for h in history)
    ppo = _invoke(["run", "configs/grpo-arithmetic.yaml", "--run-id", f"hub-ppo-{arch}",
                   *_sets(arch, chat_data, f"task.policy_model={base}", "rollout.engine=hf", "train.algorithm=ppo",
                          "train.total_iterations=1")])
    assert ppo["iterations_done"] == 1 and ppo["engine"] == "hf"

    tok = load_tokenizer(standins[arch])
    rows = open_store().read_stage(stage_prefix(f"hub-grpo-{arch}", 1, "verify"), schema=TRAJECTORY_SCHEMA).to_pylist()
    prompts = {tok.decode(r["prompt_token_ids"]) for r in rows}
    questions = [json.loads(line)["messages"][1]["content"] for line in chat_data.read_text().splitlines()]
    # Every drawn question comes back verbatim from the stored token ids (Chinese ones included).
    assert all(sum(f"\n{q}<|" in p or f"\n\n{q}<|" in p for q in questions) == 1 for p in prompts)
    assert all(p.startswith("<|im_start|>system" if arch == "qwen2" else "<|begin_of_text|><|start_header_id|>system")
               for p in prompts)
    assert all(r["reward_status"] == "ok" for r in rows)
    cfg = load_config("configs/grpo-arithmetic.yaml", [f"task.name=hub-{arch}", f"tracking.experiment=hub-{arch}"])
    versions = Tracker(settings(), cfg).client.search_model_versions(f"name='{cfg.registered_model}'")
    mine = [mv for mv in versions if mv.tags.get("run_id") == f"hub-grpo-{arch}"]
    assert len(mine) == 2
    from rlpipe.training.models import fetch_source

    registered = fetch_source(mine[-1].source, settings())  # the version carries the checkpoint's own text setup
    assert load_tokenizer(registered).chat_template == tok.chat_template
    gen = lambda f: json.loads((f / "generation_config.json").read_text())["eos_token_id"]  # noqa: E731
    assert gen(registered) == gen(standins[arch])


# Both families (each drill is ~50 s of the suite): the Qwen2 stand-in with LoRA, whose resume has the most to
# put back (the adapter onto the start model, the reference as the base with adapters off), and the Llama one
# (untied, fp16, EOS a list, no pad token) with every weight trained in bfloat16 beside float32 masters
# (train.precision bf16_weights: the resume must take the masters from the save point, not the rounded weights;
# an entropy bonus moves the policy where every reward of the untrained stand-in is 0).
@pytest.mark.parametrize("arch,extra", [("qwen2", ["train.lora={r: 8}", "train.gradient_checkpointing=true",
                                                   "train.kl_coef=0.01"]),
                                        ("llama", ["train.precision=bf16_weights", "train.zero_stage=1",
                                                   "train.entropy_coef=0.01"])],
                         ids=["qwen2-lora", "llama-bf16-weights"])
def test_kill_then_resume_on_a_hub_checkpoint(prefect_harness, standins, chat_data, arch, extra):
    """Killed after iteration 1's update, resumed from iteration 0's save point: the same final weights as a run
    never killed (LoRA: the adapter put back on the start model, the reference the base with adapters off)."""
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    sets = _sets(arch, chat_data, f"task.policy_model={standins[arch]}", "rollout.engine=hf",
                 "train.total_iterations=2", f"tracking.experiment=hub-kill-{arch}", *extra)
    ref = _cli(["run", "configs/grpo-arithmetic.yaml", "--run-id", f"hub-kill-ref-{arch}", *sets], {}, api)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = _cli(["run", "configs/grpo-arithmetic.yaml", "--run-id", f"hub-kill-{arch}", *sets], {"RLPIPE_FAULT": "1:update"}, api)
    assert killed.returncode == -9, killed.stderr[-3000:]
    done = _cli(["run", "configs/grpo-arithmetic.yaml", "--run-id", f"hub-kill-{arch}", *sets], {}, api)
    assert done.returncode == 0, done.stderr[-3000:]
    got, want = (json.loads((settings().run_dir(r) / "summary.json").read_text()) for r in (f"hub-kill-{arch}", f"hub-kill-ref-{arch}"))
    assert got["final_policy_version"] == want["final_policy_version"]
    history = read_history(settings().run_dir(f"hub-kill-{arch}"))
    assert [h["iteration"] for h in history] == [0, 1]
    assert all(h["sync/adapter_only"] == 0.0 for h in history)  # the HF engine takes the merged weights
    assert all(h["sync/probe_max_abs_diff"] < 1e-4 for h in history)  # float32's tolerance, bfloat16 weights or not
    first = {r["policy_version"] for r in open_store().read_stage(stage_prefix(f"hub-kill-{arch}", 0, "verify"),
                                                                  schema=TRAJECTORY_SCHEMA).to_pylist()}
    assert len(first) == 1 and got["final_policy_version"] not in first  # the updates moved the policy the engine runs
    if arch == "qwen2":
        cfg = load_config("configs/grpo-arithmetic.yaml", [s for s in sets[1::2]])
        mv = Tracker(settings(), cfg).version_by_alias(cfg.registered_model, "latest")
        assert mv.tags["lora_r"] == "8" and mv.tags["lora_base"] == str(standins[arch])
        assert mv.tags["lora_adapter"].endswith("/adapter")


def test_chat_data_for_a_tokenizer_without_a_template_is_refused_before_the_engine(prefect_harness, standins, chat_data,
                                                                                   tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(standins["qwen2"], bare)
    (bare / "chat_template.jinja").unlink()
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    res = CliRunner().invoke(app, ["run", "configs/grpo-arithmetic.yaml", "--run-id", "hub-no-template",
                                   *_sets("qwen2", chat_data, f"task.policy_model={bare}", "rollout.engine=vllm",
                                          "train.total_iterations=1")])
    assert res.exit_code != 0
    assert "no chat template" in str(res.exception) + res.output  # start_services checks it before the engine
