"""The shipped configs, samples and deployments are valid as shipped."""

from pathlib import Path

import pytest
import yaml

from rlpipe.config import load_config
from rlpipe.data import load_prompts, validate_prompts

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    load_config(path)


@pytest.mark.parametrize("path", sorted((ROOT / "datasets" / "samples").glob("*.jsonl")), ids=lambda p: p.name)
def test_shipped_samples_validate(path):
    assert validate_prompts(load_prompts(path)) == []


def test_prefect_yaml_entrypoints_are_flows():
    from prefect import Flow

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    assert spec["deployments"]
    import importlib.util

    for dep in spec["deployments"]:
        file, func = dep["entrypoint"].split(":")
        module = importlib.util.spec_from_file_location(f"_ep_{func}", ROOT / file)
        mod = importlib.util.module_from_spec(module)
        module.loader.exec_module(mod)
        assert isinstance(getattr(mod, func), Flow), dep["entrypoint"]
        assert dep["work_pool"]["name"] == "rlpipe-local"


def test_readme_starts_with_the_two_commands():
    head = (ROOT / "README.md").read_text().splitlines()[:10]
    assert any("make demo" in line for line in head) and any("make test" in line for line in head)
