"""Render docs/configuration.md, the configuration reference, from `rlpipe config schema`.

The run config's JSON schema (pydantic's, with a description on every field) is the one source: this
script turns it into one section per config section and a table of its fields (name, type, default,
description), nested sections (`train.critic`, `alerts.kl_high`, …) as sections of their own. The
output depends only on the schema, so the committed page can be checked against it
(`tests/test_docs.py`). Run it after changing a config field:

    .venv/bin/python scripts/config_reference.py           # rewrite docs/configuration.md
    .venv/bin/python scripts/config_reference.py --check   # exit 1 when the page is stale
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "configuration.md"

HEADER = """\
# Configuration reference

Every field of a run config, generated from `rlpipe config schema` by `scripts/config_reference.py`
(do not edit this page by hand: change the field's description in the config models and run
`.venv/bin/python scripts/config_reference.py`). How config files, `extends:`, `--set`, fingerprints and
the `RLPIPE_*` environment variables work: [run-config.md](run-config.md).

A default of `—` means the schema gives none: the field is a nested section (its own table below) or
a list or map the model builds. `required` means the field must be given.
"""


def load_schema() -> dict:
    """The schema exactly as the CLI prints it (the command a user would run)."""
    rlpipe = Path(sys.executable).with_name("rlpipe")
    out = subprocess.run([str(rlpipe), "config", "schema"], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _bounds(spec: dict) -> str:
    parts = []
    for key, sign in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"), ("exclusiveMaximum", "<")):
        if key in spec:
            parts.append(f"{sign} {spec[key]}")
    return " " + ", ".join(parts) if parts else ""


def type_of(spec: dict, paths: dict[str, tuple[str, str]]) -> str:
    """A field's type in words: `integer ≥ 1`, `one of "a", "b"`, `list of string`, a nested section's path."""
    if "$ref" in spec:
        name = _ref_name(spec["$ref"])
        return f"[`{paths[name][0]}`](#{_anchor(paths[name][0])})" if name in paths else f"`{name}`"
    if "anyOf" in spec:
        return " or ".join(type_of(option, paths) for option in spec["anyOf"])
    if "const" in spec:
        return json.dumps(spec["const"])
    if "enum" in spec:
        return "one of " + ", ".join(f"`{json.dumps(v)}`" for v in spec["enum"])
    kind = spec.get("type")
    if kind == "array":
        return "list of " + (type_of(spec["items"], paths) if "items" in spec else "any")
    if kind == "object":
        values = spec.get("additionalProperties")
        return "map of string → " + (type_of(values, paths) if isinstance(values, dict) else "any")
    if kind is None:
        return "any"
    return f"{kind}{_bounds(spec)}"


def _anchor(path: str) -> str:
    """GitHub's anchor for a heading that is just `path` in backticks."""
    return "".join(c for c in path.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def default_of(name: str, spec: dict, required: set[str]) -> str:
    if name in required:
        return "required"
    if "default" not in spec:
        return "—"
    return f"`{json.dumps(spec['default'], ensure_ascii=False)}`"


def section_paths(schema: dict) -> dict[str, tuple[str, str]]:
    """Each model of `$defs` → (the dotted path it is first reached at, that field's description), in
    depth-first field order, so a nested section follows its parent."""
    paths: dict[str, tuple[str, str]] = {}

    def visit(prefix: str, model: dict) -> None:
        for field, spec in model.get("properties", {}).items():
            for ref in (r["$ref"] for r in [spec, *spec.get("anyOf", [])] if "$ref" in r):
                name = _ref_name(ref)
                if name not in paths:
                    paths[name] = (f"{prefix}{field}", spec.get("description", ""))
                    visit(f"{prefix}{field}.", schema["$defs"][name])

    visit("", schema)
    return paths


def table(model: dict, paths: dict[str, tuple[str, str]]) -> list[str]:
    required = set(model.get("required", []))
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for field, spec in model.get("properties", {}).items():
        cells = (f"`{field}`", type_of(spec, paths), default_of(field, spec, required), spec.get("description", ""))
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return rows


def render(schema: dict) -> str:
    paths = section_paths(schema)
    lines = [HEADER, f"## `{schema.get('title', 'RunConfig')}`", "", _cell(schema.get("description", "")), ""]
    lines += table(schema, paths)
    for name, (path, what) in paths.items():
        model = schema["$defs"][name]
        about = " ".join(t for t in (what, model.get("description", "")) if t)
        lines += ["", f"## `{path}`", "", f"{_cell(about)} (`{name}`)", ""]
        lines += table(model, paths)
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    text = render(load_schema())
    if "--check" in argv:
        if OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run .venv/bin/python scripts/config_reference.py")
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
