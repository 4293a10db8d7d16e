"""YAML files as strict models (:mod:`rlpipe.yamlio`): unknown keys refused, every problem by its YAML path,
``extends:`` chains merged section by section."""

import pytest
from pydantic import Field

from rlpipe.yamlio import ConfigError, Strict, read_yaml, validate_model, yaml_path


class _Inner(Strict):
    n: int = Field(1, ge=1)


class _Outer(Strict):
    inner: _Inner = Field(default_factory=_Inner)
    names: list[str] = Field(default_factory=list)


def test_every_problem_is_named_by_its_yaml_path():
    with pytest.raises(ConfigError) as e:
        validate_model(_Outer, {"inner": {"n": 0, "m": 1}, "names": ["a", 2]}, "x.yaml")
    problems = dict(e.value.problems)
    assert "greater than or equal to 1" in problems["inner.n"]
    assert problems["inner.m"].startswith("unknown key")
    assert "valid string" in problems["names[1]"]
    assert e.value.source == "x.yaml" and str(e.value).startswith("x.yaml: 3 problem(s)")


def test_the_top_level_must_be_a_mapping_and_empty_means_defaults():
    with pytest.raises(ConfigError, match="must be a mapping, got list"):
        validate_model(_Outer, [1], "x.yaml")
    assert validate_model(_Outer, None, "x.yaml") == _Outer()


def test_assignments_are_validated():
    m = _Outer()
    with pytest.raises(ValueError):
        m.inner = {"n": 0}


def test_extends_merges_section_by_section_and_refuses_a_loop(tmp_path):
    (tmp_path / "base.yaml").write_text("a: {x: 1, y: 2}\nb: 1\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\na: {y: 3}\n")
    assert read_yaml(tmp_path / "child.yaml") == {"a": {"x": 1, "y": 3}, "b": 1}
    (tmp_path / "loop.yaml").write_text("extends: loop.yaml\n")
    with pytest.raises(ConfigError, match="circular"):
        read_yaml(tmp_path / "loop.yaml")
    with pytest.raises(ConfigError, match="file not found"):
        read_yaml(tmp_path / "missing.yaml")


def test_yaml_path():
    assert yaml_path(("a", "b", 2, "c")) == "a.b[2].c" and yaml_path(()) == ""
