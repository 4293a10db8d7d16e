import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.config import ConfigError, RunConfig, apply_overrides, load_config, settings


def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def problems(path, overrides=None):
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return dict(e.value.problems)


def test_defaults_are_valid_and_fingerprint_is_stable():
    a, b = RunConfig(), load_config(None)
    assert a.fingerprint() == b.fingerprint()
    assert len(a.fingerprint()) == 64
    assert RunConfig(seed=1).fingerprint() != a.fingerprint()


def test_seed_design_config_loads(tmp_path):
    p = write(tmp_path, """
task: {name: gsm8k, policy_model: tiny, ref_model: tiny, dataset: builtin:arithmetic}
reward: {type: rule_based, verifier: math}
rollout: {engine: vllm, batch_size: 8, samples_per_prompt: 8, max_new_tokens: 6, temperature: 1.0, top_p: 1.0}
train: {algorithm: grpo, lr: 3.0e-5, kl_coef: 0.0, clip_ratio: 0.2, batch_size: 64, micro_batch_size: 16,
        zero_stage: 1, total_iterations: 20, save_interval: 5}
storage: {uri: s3://bucket/rlpipe}
tracking: {experiment: demo}
seed: 3
""")
    cfg = load_config(p)
    assert cfg.train.zero_stage == 1 and cfg.seed == 3
    assert cfg.flat()["train.lr"] == 3e-5


def test_unknown_keys_are_errors_with_their_path(tmp_path):
    p = write(tmp_path, "train:\n  learning_rate: 0.1\nrollout:\n  temprature: 1.0\nbogus: 1\n")
    found = problems(p)
    assert set(found) == {"train.learning_rate", "rollout.temprature", "bogus"}
    assert all("unknown key" in m for m in found.values())


def test_every_problem_is_reported_at_once(tmp_path):
    p = write(tmp_path, """
rollout: {temperature: -1, top_p: 2}
train: {lr: 0, zero_stage: 5, batch_size: 8, micro_batch_size: 16}
data: {operations: [add, pow]}
reward: {type: magic}
""")
    found = problems(p)
    for key in ("rollout.temperature", "rollout.top_p", "train.lr", "train.zero_stage", "data.operations[1]", "reward.type"):
        assert key in found, (key, found)


def test_micro_batch_larger_than_batch_names_both_fields(tmp_path):
    p = write(tmp_path, "train: {batch_size: 8, micro_batch_size: 16}\n")
    found = problems(p)
    assert "micro_batch_size (16) exceeds batch_size (8)" in found["train"]


def test_endpoints_and_credentials_are_refused_in_yaml(tmp_path):
    p = write(tmp_path, """
tracking: {uri: "http://mlflow.internal:5000"}
reward: {endpoint: "https://verifier:8000"}
storage: {uri: "s3://key:secret@bucket/x"}
""")
    found = problems(p)
    assert "RLPIPE_TRACKING_URI" in found["tracking.uri"]
    assert "RLPIPE_VERIFIER_URL" in found["reward.endpoint"]
    assert "credentials" in found["storage.uri"]


def test_not_yaml_not_a_mapping_and_missing_file(tmp_path):
    assert "not valid YAML" in problems(write(tmp_path, "train: [1, 2\n"))[""]
    assert "mapping" in problems(write(tmp_path, "- 1\n- 2\n"))[""]
    assert "file not found" in problems(tmp_path / "nope.yaml")[""]


def test_overrides_are_typed_and_validated(tmp_path):
    p = write(tmp_path, "train: {lr: 1.0e-4}\n")
    cfg = load_config(p, ["train.lr=1e-5", "data.operations=[add, mul]", "reward.code_scoring=all", "seed=7"])
    assert cfg.train.lr == 1e-5 and cfg.data.operations == ["add", "mul"] and cfg.reward.code_scoring == "all" and cfg.seed == 7
    assert "train.nope" in problems(p, ["train.nope=1"])
    with pytest.raises(ConfigError):
        apply_overrides({}, ["no-equals-sign"])
    with pytest.raises(ConfigError):
        apply_overrides({"seed": 1}, ["seed.x=2"])


def test_settings_come_from_rlpipe_env(tmp_path):
    s = settings({"RLPIPE_HOME": str(tmp_path), "RLPIPE_TRACKING_URI": "http://mlflow:5000", "AWS_ACCESS_KEY_ID": "k"})
    assert s.resolve_tracking_uri() == "http://mlflow:5000"
    assert s.s3_access_key_id == "k"
    assert s.resolve_storage_uri(RunConfig()) == str((tmp_path / "store").resolve())
    assert s.resolve_storage_uri(RunConfig.model_validate({"storage": {"uri": "s3://b/p"}})) == "s3://b/p"
    assert "secret" not in repr(settings({"RLPIPE_S3_SECRET_ACCESS_KEY": "secret"}))


def test_cli_config_validate(tmp_path):
    runner = CliRunner()
    good = write(tmp_path, "seed: 1\n", "good.yaml")
    res = runner.invoke(app, ["config", "validate", str(good), "--set", "train.lr=1e-5"])
    assert res.exit_code == 0 and "fingerprint" in res.output
    bad = write(tmp_path, "train: {lr: -1, optimiser: adam}\n", "bad.yaml")
    res = runner.invoke(app, ["config", "validate", str(bad)])
    assert res.exit_code == 2
    assert "train.lr" in res.output and "train.optimiser" in res.output and "2 problem(s)" in res.output
    res = runner.invoke(app, ["config", "schema"])
    schema = json.loads(res.output)
    # Every field carries documentation (the Prefect UI form and `config schema` show it).
    for name, model in schema["$defs"].items():
        for field, spec in model["properties"].items():
            assert spec.get("description"), f"{name}.{field} has no description"


def test_extends_merges_sections_and_the_extending_file_wins(tmp_path):
    (tmp_path / "base").mkdir()
    write(tmp_path / "base", "rollout: {batch_size: 16, samples_per_prompt: 4}\ntrain: {lr: 1.0e-4, kl_coef: 0.01}\nseed: 3\n", "b.yaml")
    write(tmp_path, "extends: base/b.yaml\ntrain: {lr: 2.0e-5}\n", "mid.yaml")
    top = write(tmp_path, "extends: mid.yaml\nrollout: {batch_size: 8}\n", "top.yaml")
    cfg = load_config(top)
    assert (cfg.rollout.batch_size, cfg.rollout.samples_per_prompt) == (8, 4)
    assert (cfg.train.lr, cfg.train.kl_coef, cfg.seed) == (2e-5, 0.01, 3)
    assert load_config(top, ["train.lr=5e-6"]).train.lr == 5e-6  # --set wins over the whole chain
    assert "extends" not in json.dumps(cfg.model_dump(mode="json"))


def test_extends_cycles_and_missing_bases_are_named(tmp_path):
    a = write(tmp_path, "extends: b.yaml\n", "a.yaml")
    write(tmp_path, "extends: a.yaml\n", "b.yaml")
    assert "circular" in problems(a)["extends"]
    c = write(tmp_path, "extends: nope.yaml\n", "c.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(c)
    assert "nope.yaml" in str(e.value) and "c.yaml" in str(e.value)


def test_algorithm_settings_are_checked(tmp_path):
    assert "unknown algorithm 'grpoo'" in problems(None, ["train.algorithm=grpoo"])["train"]
    assert "valid:" in problems(None, ["train.advantage=nope"])["train"]
    assert "kl_coef > 0" in problems(None, ["train.kl_target=0.1"])["train"]
    assert "must be below rollout.max_new_tokens" in problems(None, ["reward.overlong_buffer=8", "rollout.max_new_tokens=8"])[""]
    assert "train.dual_clip" in problems(None, ["train.dual_clip=0.5"])
    assert "train.loss_agg_mode" in problems(None, ["train.loss_agg_mode=sum"])
    cfg = load_config(None, ["train.algorithm=dr_grpo", "train.policy_loss=gspo"])
    assert cfg.train.resolved() == {"advantage": "dr_grpo", "policy_loss": "gspo", "loss_agg_mode": "constant"}
    assert load_config(None, ["train.clip_ratio_high=0.28"]).train.loss_kwargs() == {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": None}


@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "dapo", "gspo", "ppo", "rloo", "reinforce_pp"])
def test_presets_resolve_to_their_method(preset):
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "presets" / f"{preset}.yaml")
    assert cfg.train.algorithm == preset and cfg.task.name == "arithmetic"
    parts = cfg.train.resolved()
    assert parts["advantage"] == {"ppo": "gae", "dapo": "grpo", "gspo": "grpo"}.get(preset, preset)
    assert (parts["policy_loss"] == "gspo") == (preset == "gspo")
    assert cfg.rollout.dynamic_sampling == (preset == "dapo")


@pytest.mark.parametrize("text,path,words", [
    ("reward: {type: model_based}\n", "reward.type", "use type: model"),
    ("reward: {weights: {model: 1.0}}\n", "reward.weights", "set type: model"),
    ("reward: {type: model, weights: {format: 1.0}}\n", "reward.weights", "needs a 'model' weight"),
    ("reward: {normalize: true}\n", "reward.normalize", "needs type: model"),
    ("rm: {batch_size: 10, micro_batch_size: 4}\n", "rm.micro_batch_size", "does not divide"),
    ("reward: {endpoint: verifier-host}\n", "reward.endpoint", "RLPIPE_VERIFIER_URL"),
    ("reward: {timeout_s: 10}\n", "reward.timeout_s", "reward.grace_s"),
    ("agent: {env: no-such-file.yaml}\n", "agent", "file not found"),
    ("agent: {env: {env: calculator, params: {digits: 99}}}\n", "agent.env.params.digits", "less than or equal to 9"),
    ("agent: {env: {env: calculator}, sft_trace: 3}\n", "agent.sft_trace", "unknown key"),
    ("agent: {env: {env: calculator}}\ntask: {dataset: builtin:episodes}\nreward: {type: model}\n", "reward.type", "environment's"),
    ("agent: {env: {env: calculator}}\n", "task.dataset", "builtin:episodes"),
    ("agent: {env: {env: calculator}, allow_hosts: ['127.0.0.1:80']}\n", "agent.allow_hosts", "executor: sandbox"),
    ("agent: {env: {env: calculator}, executor: sandbox, allow_hosts: ['nohost']}\n", "agent.allow_hosts", "host:port"),
    ("agent: {env: {env: guess}, sft_tool_share: 0.5}\n", "agent.sft_tool_share", "without the tool"),
    ("agent: {env: {env: calculator}, sft_tool_share: 0}\n", "agent.sft_tool_share", "greater than 0"),
    ("reward: {sandbox_min_level: bwrap+chroot}\n", "reward.sandbox_min_level", "'chroot'"),
    ("reward: {code_scoring: most}\n", "reward.code_scoring", "fraction"),
    ("reward: {max_invalid_share: 1.5}\n", "reward.max_invalid_share", "less than or equal"),
])
def test_keys_nothing_implements_are_refused_by_path(tmp_path, text, path, words):
    found = problems(write(tmp_path, text))
    assert path in found and words in found[path], found


def test_reward_options_reach_the_verifiers_and_the_floor_is_parsed():
    cfg = RunConfig.model_validate({"reward": {"code_scoring": "all", "sandbox_min_level": "seccomp+rlimits"}})
    assert cfg.reward.verifier_options() == {"code": {"scoring": "all"}}
    assert cfg.reward.required_sandbox_components() == ("seccomp", "rlimits")
    assert RunConfig().reward.required_sandbox_components() == ("bwrap", "seccomp", "uid", "rlimits", "cgroup")


@pytest.mark.parametrize("override,path,words", [
    ("rollout.top_p=0.9", "rollout.top_p", "use 1.0"),
    ("rollout.temperature=0", "rollout.temperature", "temperature > 0"),
    ("train.offload_optimizer=true", "train.offload_optimizer", "needs ZeRO"),
    ("sft.nproc=3", "sft.nproc", "3 ranks do not divide sft.batch_size 64"),
    ("train.tis_cap=0", "train.tis_cap", "greater than 0"),
])
def test_settings_the_trainer_cannot_honour_are_refused(override, path, words):
    found = problems(None, [override])
    assert path in found and words in found[path], found


def test_each_algorithm_gets_its_own_clip_range_unless_one_is_set():
    def clip(*sets):
        kw = load_config(None, list(sets)).train.loss_kwargs()
        return kw["clip_low"], kw["clip_high"]

    assert clip("train.algorithm=grpo") == (0.2, 0.2)
    assert clip("train.algorithm=gspo") == (3e-4, 4e-4)  # not PPO's 0.2, which would never clip a sequence ratio
    assert clip("train.algorithm=dapo") == (0.2, 0.28)
    assert clip("train.algorithm=gspo", "train.clip_ratio=0.001") == (0.001, 0.001)
    assert clip("train.algorithm=dapo", "train.clip_ratio_high=0.3") == (0.2, 0.3)


def test_the_rlhf_demo_runs_the_recipe_in_configs():
    """`rlpipe demo rlhf` (embedded overrides) and configs/*-arithmetic-rlhf.yaml train the same thing."""
    from rlpipe.cli import RLHF_DEMO

    root = Path(__file__).resolve().parents[1] / "configs"
    demo = load_config(None, RLHF_DEMO)
    for name, sections in (("sft-arithmetic-rlhf.yaml", ("task.name", "task.dataset", "data", "model", "sft")),
                           ("rm-arithmetic-rlhf.yaml", ("rm.steps", "rm.lr", "rm.eval_every", "rm.patience", "rm.dataset")),
                           ("grpo-arithmetic-rlhf.yaml", ("reward.type", "rollout", "train"))):
        recipe = load_config(root / name).model_dump()
        mine = demo.model_dump()
        for dotted in sections:
            a, b = recipe, mine
            for part in dotted.split("."):
                a, b = a[part], b[part]
            assert a == b, (name, dotted)
    assert load_config(root / "ppo-arithmetic-rlhf.yaml").train.algorithm == "ppo"


def test_the_agent_demo_runs_the_recipe_in_configs():
    """`rlpipe demo agent` (embedded overrides) and configs/*-agent-calculator.yaml train the same thing."""
    import os

    from rlpipe.cli import AGENT_DEMO

    root = Path(__file__).resolve().parents[1]
    demo = load_config(None, AGENT_DEMO).model_dump()
    cwd = os.getcwd()
    os.chdir(root)  # agent.env is relative to where rlpipe runs
    try:
        sft = load_config(root / "configs/sft-agent-calculator.yaml").model_dump()
        rl = load_config(root / "configs/grpo-agent-calculator.yaml").model_dump()
    finally:
        os.chdir(cwd)
    for recipe, sections in ((sft, ("task.name", "task.dataset", "agent", "data", "sft")), (rl, ("agent", "rollout", "train"))):
        for dotted in sections:
            a, b = recipe, demo
            for part in dotted.split("."):
                a, b = a[part], b[part]
            assert a == b, dotted


def test_the_config_names_the_services_and_a_variable_overrides_a_key():
    from rlpipe.config import RunConfig, settings
    from rlpipe.resume import config_changes, resume_fingerprint

    cfg = RunConfig.model_validate({"services": {"rollout": ["http://gen-0:8768", "http://gen-1:8768"],
                                                 "trainer": "http://train-0:8769", "verifier": "http://cpu-0:8765"}})
    s = settings({"RLPIPE_HOME": "/tmp/x"}).for_run(cfg)
    assert s.rollout_urls == ("http://gen-0:8768", "http://gen-1:8768") and s.trainer_url == "http://train-0:8769"
    assert s.verifier_url == "http://cpu-0:8765" and s.reward_model_url is None and s.env_url is None
    over = settings({"RLPIPE_HOME": "/tmp/x", "RLPIPE_TRAINER_URL": "http://local:1", "RLPIPE_ROLLOUT_URL": "http://a:1,http://b:2"})
    assert over.for_run(cfg).trainer_url == "http://local:1"
    assert over.for_run(cfg).rollout_urls == ("http://a:1", "http://b:2")
    assert settings({"RLPIPE_HOME": "/tmp/x"}).for_run(RunConfig()).trainer_url is None  # in-process by default
    # where the services run is not the experiment: a resume may move them
    assert resume_fingerprint(cfg) == resume_fingerprint(RunConfig()) and config_changes(cfg.flat(), RunConfig().flat()) == []


@pytest.mark.parametrize("services", [{"trainer": "train-0:8769"}, {"rollout": ["http://a:1", "ftp://b"]},
                                      {"tokens": "x"}])
def test_a_service_that_is_not_an_http_url_is_a_config_error(services):
    from rlpipe.config import ConfigError, validate_raw

    with pytest.raises(ConfigError) as e:
        validate_raw({"services": services}, "run.yaml")
    assert "services" in str(e.value)


def test_a_run_recorded_before_a_key_existed_resumes_at_its_old_behaviour():
    from rlpipe.config import RunConfig
    from rlpipe.progress import Progress
    from rlpipe.resume import ADDED_KEYS, ResumeRefused, check_resume, config_changes, resume_fingerprint

    now = RunConfig()
    before = {k: v for k, v in now.flat().items() if k not in ADDED_KEYS}  # recorded by an older rlpipe
    assert set(ADDED_KEYS) <= set(now.flat())  # each one a real key, at its default …
    assert all(now.flat()[k] == v for k, v in ADDED_KEYS.items())  # … which is the old behaviour
    assert config_changes(before, now.flat()) == []
    assert check_resume(Progress(config=before, dataset_version="d"), now, "d", allow_change=False) == []
    bf16 = RunConfig.model_validate({"train": {"precision": "bf16"}})
    assert config_changes(before, bf16.flat()) == ["train.precision: 'fp32' → 'bf16'"]  # not the old behaviour
    with pytest.raises(ResumeRefused, match="train.precision"):
        check_resume(Progress(config=before, dataset_version="d"), bf16, "d", allow_change=False)
    assert resume_fingerprint(bf16) != resume_fingerprint(now)
    # A key dropped from the new config is still a change, whatever its value.
    assert config_changes(now.flat() | {"train.removed": 1}, now.flat()) == ["train.removed: 1 → '<absent>'"]
