"""Clones on one machine are independent (``scripts/install.sh``): they share the dependency venv,
never the project's own install, so deleting or changing one clone breaks no other.

The clones are git clones of HEAD (a consistent tree) carrying this checkout's install.sh, and they
use the shared venv this checkout's pins already built (the test skips rather than build one).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHOW = ("import rlpipe, flows, tasks\n"
        "for m in (rlpipe, flows, tasks): print(m.__file__)\n"
        "print(getattr(rlpipe, 'CLONE_MARK', '-'))")


def _env() -> dict[str, str]:
    """Our environment minus what would point imports at this checkout (make test's PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return env | {"RLPIPE_NO_SYSTEM_PACKAGES": "1"}


def _run(args: list, cwd: Path, timeout: float = 600) -> str:
    p = subprocess.run([str(a) for a in args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{args} in {cwd} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def _clone(dst: Path) -> Path:
    """A git clone of HEAD with this checkout's install.sh; skips unless its shared venv is built."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs git and a git checkout to clone")
    _run(["git", "clone", "-q", ROOT, dst], cwd=dst.parent)
    shutil.copy2(ROOT / "scripts" / "install.sh", dst / "scripts" / "install.sh")
    if not (_shared(dst) / ".complete").exists():
        pytest.skip(f"the shared venv for these pins ({_shared(dst)}) is not built; run `make install` first")
    return dst


def _shared(clone: Path) -> Path:
    return Path(_run(["bash", "scripts/install.sh", "--venv-path"], cwd=clone).strip())


def _install(clone: Path) -> str:
    return _run(["bash", "scripts/install.sh"], cwd=clone)


def _imports(clone: Path, cwd: Path) -> list[str]:
    """rlpipe's, flows' and tasks' files as clone's venv imports them, and rlpipe.CLONE_MARK."""
    return _run([clone / ".venv" / "bin" / "python", "-c", SHOW], cwd=cwd).splitlines()


def _own(clone: Path, mark: str = "-") -> list[str]:
    return [str(clone / "src" / "rlpipe" / "__init__.py"), str(clone / "flows" / "__init__.py"),
            str(clone / "tasks" / "__init__.py"), mark]


def _check_works(clone: Path, cwd: Path, mark: str = "-") -> None:
    assert _imports(clone, cwd) == _own(clone, mark)
    assert "Usage: rlpipe" in _run([clone / ".venv" / "bin" / "rlpipe", "--help"], cwd=cwd)


def test_two_clones_share_the_dependencies_but_not_the_project(tmp_path):
    a, b = _clone(tmp_path / "a"), _clone(tmp_path / "b")
    shared_venv = _shared(a)
    for clone in (a, b):
        _install(clone)
    for clone in (a, b):
        venv = clone / ".venv"
        assert venv.is_dir() and not venv.is_symlink()
        _check_works(clone, tmp_path)
        # The dependencies' console scripts run this clone's python (so they see this clone's rlpipe).
        prefect = (venv / "bin" / "prefect").read_text().splitlines()[0]
        assert prefect == f"#!{venv / 'bin' / 'python'}", prefect
        assert _run([venv / "bin" / "tqdm", "--version"], cwd=tmp_path).strip()
    # The shared venv holds no rlpipe of any clone.
    found = _run([shared_venv / "bin" / "python", "-c", "import importlib.util as u; print(u.find_spec('rlpipe'))"],
                 cwd=tmp_path)
    assert found.strip() == "None" and not (shared_venv / "bin" / "rlpipe").exists()

    # Changing a source file in one clone changes what that clone imports, and only that.
    init = a / "src" / "rlpipe" / "__init__.py"
    init.write_text(init.read_text() + "\nCLONE_MARK = 'a'\n")
    _check_works(a, tmp_path, mark="a")
    _check_works(b, tmp_path)

    # Deleting a clone breaks no other.
    shutil.rmtree(a)
    _check_works(b, tmp_path)

    # A repeat install is a no-op: nothing rebuilt, nothing reinstalled.
    before = (b / ".venv").stat().st_ino, (b / ".venv" / "bin" / "rlpipe").stat().st_mtime_ns
    assert _install(b) == ""
    assert ((b / ".venv").stat().st_ino, (b / ".venv" / "bin" / "rlpipe").stat().st_mtime_ns) == before


def test_an_older_symlinked_venv_becomes_the_clones_own(tmp_path):
    """Older install.sh versions made `.venv` a symlink to the shared venv."""
    c = _clone(tmp_path / "c")
    shared_venv = _shared(c)
    (c / ".venv").symlink_to(shared_venv)
    _install(c)
    assert (c / ".venv").is_dir() and not (c / ".venv").is_symlink()
    _check_works(c, tmp_path)
    assert (shared_venv / "bin" / "python").exists()  # the shared venv itself is untouched
