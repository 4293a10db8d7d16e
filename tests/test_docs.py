"""The documentation stays true to the tree: the configuration reference matches the config schema,
every relative link and every repository path in backticks in README.md, docs/ and benchmarks/ reaches a
file, and the README stays a ten-minute read."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md",
         ROOT / "benchmarks" / "history.md"]
# [text](target) and ![alt](target), the target up to a space or the closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _config_reference():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_generated_from_the_schema():
    ref = _config_reference()
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == ref.render(ref.load_schema()), "run .venv/bin/python scripts/config_reference.py"


def _links(page: Path):
    fence = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            for target in LINK.findall(line):
                yield number, target


@pytest.mark.parametrize("page", [p for p in PAGES if p.exists()], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_a_file(page):
    broken = []
    for number, target in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor on the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(f"{page.relative_to(ROOT)}:{number}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


# `src/rlpipe/config.py`, `rlpipe/rollout/probe.py`, `configs/grpo-chat.yaml`: a path from the repository root
# (or from src/ for rlpipe/), up to a `:` naming a function; placeholders (`<run_id>`, `*.yaml`) are skipped
REPO_PATH = re.compile(r"`((?:src|flows|tasks|configs|benchmarks|tests|infra|datasets|scripts|requirements|rlpipe)/"
                       r"[^`\s:]*)")


def _exists(path: str) -> bool:
    if path.startswith("rlpipe/"):
        path = "src/" + path
    target = ROOT / path.rstrip(".,")
    # a module split into a package of the same name (config.py -> config/) is still where the text says
    return target.exists() or (target.suffix == ".py" and target.with_suffix("").is_dir())


@pytest.mark.parametrize("page", [p for p in PAGES if p.exists() and p.name != "history.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_repository_paths_exist(page):
    """history.md is left out: it records the tree as it was when each figure was taken."""
    stale = [f"{page.relative_to(ROOT)}:{number}: {path}"
             for number, line in enumerate(page.read_text().splitlines(), 1)
             for path in REPO_PATH.findall(line)
             if not any(c in path for c in "<*{") and not _exists(path)]
    assert not stale, "paths that are not in the repository (moved? update the page):\n" + "\n".join(stale)


def test_readme_is_a_ten_minute_read():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail to docs/"
