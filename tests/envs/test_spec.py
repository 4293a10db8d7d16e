"""Environment specs (:mod:`rlpipe.envs.spec`): YAML files validated like run configs, every problem by its
YAML path."""

from pathlib import Path

import pytest

from rlpipe.envs import EnvSpec, load_env_spec
from rlpipe.yamlio import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["calculator.yaml", "guess.yaml"])
def test_shipped_specs_load_and_make_working_environments(name):
    spec = load_env_spec(ROOT / "configs" / "envs" / name)
    env = spec.make()
    assert isinstance(env.reset({}, seed=0), str)
    assert spec.limits.max_steps >= 4


@pytest.mark.parametrize("text, path, words", [
    ("env: chess\n", "env", "unknown environment 'chess'"),
    ("env: calculator\nparams: {digitz: 3}\n", "params.digitz", "unknown parameter"),
    ("env: calculator\nparams: {digits: 99}\n", "params.digits", "less than or equal to 9"),
    ("env: guess\nparams: {lo: 5, hi: 5}\n", "params", "must be above lo"),
    ("env: guess\ntools: [calc]\n", "tools", "unknown tool(s) ['calc']"),
    ("env: guess\nlimits: {max_step: 3}\n", "limits.max_step", "unknown key"),
    ("env: guess\nlimits: {max_steps: 0}\n", "limits.max_steps", "greater than or equal to 1"),
    ("params: {}\n", "env", "Field required"),
    ("- env: guess\n", "", "must be a mapping"),
])
def test_spec_problems_name_their_yaml_path(tmp_path, text, path, words):
    f = tmp_path / "env.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_env_spec(f)
    assert e.value.source == str(f)
    assert any(p == path and words in m for p, m in e.value.problems), e.value.problems


def test_a_spec_can_extend_another_and_restrict_the_tools(tmp_path):
    (tmp_path / "base.yaml").write_text("env: calculator\nparams: {digits: 2}\n")
    (tmp_path / "calc.yaml").write_text("extends: base.yaml\nlimits: {max_steps: 2}\ntools: []\n")
    spec = load_env_spec(tmp_path / "calc.yaml")
    assert spec.params == {"digits": 2} and spec.limits.max_steps == 2
    env = spec.make()
    env.reset({"expression": "2+3"}, seed=0)
    assert "unknown tool 'calc'" in env.step("calc(2+3)").observation  # not offered by this spec
    assert env.step("answer(5)").reward == 1.0


def test_specs_are_plain_models_too():
    assert EnvSpec(env="guess", params={"hi": 10}).make().reset({}, seed=1) == "1-10"
