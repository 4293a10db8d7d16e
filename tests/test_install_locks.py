"""The locks and the install in pip's hash-checking mode (scripts/install.sh, scripts/lock.py,
scripts/check_installed.sh, infra/docker's as tests/infra/test_manifests.py checks; docs/install.md).

Every pin of every lock carries a sha256; install.sh installs each lock with `--require-hashes --no-deps`
and checks the tree after; the environment the tests run in is exactly the locked tree. pip, given a lock
that scripts/lock.py hashed, installs the file it hashed and refuses another file of the same name, and
check_installed.sh names a dependency the lock misses: both against a one-wheel local index built here,
offline.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import Marker
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
REQ = ROOT / "requirements"
LOCKS = {"tools.txt", "torch-cpu.txt", "lock-cpu.txt", "lock-cuda.txt"}
PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;]+)(?: ; (?P<marker>[^-]+?))?(?P<hashes>( --hash=\S+)*)$")


def _entries(path: Path) -> list[str]:
    """A lock's requirements, one logical line each (continuations joined), comments left out."""
    text = path.read_text().replace("\\\n", " ")
    return [" ".join(line.split()) for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _pins(path: Path) -> dict[str, str]:
    """name → version of the pins whose marker holds here."""
    found = {}
    for entry in _entries(path):
        m = PIN.match(entry)
        if m and (not m["marker"] or Marker(m["marker"]).evaluate()):
            found[canonicalize_name(m["name"])] = m["version"]
    return found


def test_every_pin_of_every_lock_has_a_sha256():
    assert {p.name for p in REQ.glob("*.txt")} == LOCKS
    for name in sorted(LOCKS):
        entries = _entries(REQ / name)
        assert entries, name
        for entry in entries:
            m = PIN.match(entry)
            assert m, f"{name}: {entry[:120]!r} is not `name==version [; marker] --hash=...`"
            hashes = m["hashes"].split()
            assert hashes and all(re.fullmatch(r"--hash=sha256:[0-9a-f]{64}", h) for h in hashes), f"{name}: {m['name']}"
            assert len(set(hashes)) == len(hashes), f"{name}: {m['name']} lists a hash twice"
    # The CPU venv's three locks pin each package once.
    cpu = [n for lock in ("tools.txt", "torch-cpu.txt", "lock-cpu.txt") for n in _pins(REQ / lock)]
    assert len(cpu) == len(set(cpu))


def test_install_sh_installs_every_lock_in_hash_checking_mode():
    text = (ROOT / "scripts" / "install.sh").read_text()
    assert 'local pipi=("$venv/bin/pip" install -q --require-hashes --no-deps)' in text
    code = [line.strip() for line in text.splitlines() if not line.lstrip().startswith("#")]
    installs = [line for line in code if re.search(r"pip\"? install|\$\{pipi\[@\]\}", line)]
    locks = [line for line in installs if "-r " in line]
    assert locks and all(line.startswith('pipq "${pipi[@]}" ') for line in locks), locks
    # Besides the locks: the pipi array itself and the clone's own editable install, without dependencies.
    others = [line for line in installs if line not in locks]
    assert len(others) == 2 and "--no-deps --no-build-isolation -e ." in others[1], others
    named = set(re.findall(r"requirements/([\w.-]+\.txt)", "\n".join(code)))
    assert named == LOCKS
    assert 'bash scripts/check_installed.sh "$venv/bin/python"' in code and "uninstall -q -y torch" not in text


def test_the_venv_key_covers_every_lock(tmp_path):
    """A change to any lock the CPU flavour installs gives a new shared venv (the key changes)."""
    shutil.copytree(ROOT / "requirements", tmp_path / "requirements")
    (tmp_path / "scripts").mkdir()
    shutil.copy2(ROOT / "scripts" / "install.sh", tmp_path / "scripts" / "install.sh")
    env = {k: v for k, v in os.environ.items() if k != "RLPIPE_VENV_CACHE"} | {"PATH": "/usr/bin:/bin"}  # no nvidia-smi

    def venv_path() -> str:
        run = subprocess.run(["bash", "scripts/install.sh", "--venv-path"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=60, check=True)
        return run.stdout.strip()

    seen = [venv_path()]
    for lock in ("tools.txt", "torch-cpu.txt", "lock-cpu.txt"):
        with (tmp_path / "requirements" / lock).open("a") as fh:
            fh.write("# changed\n")
        seen.append(venv_path())
    assert len(set(seen)) == 4 and all("/venv-cpu-" in p for p in seen), seen


def test_this_environment_is_exactly_the_locked_tree():
    """What the tests run in (the shared venv, built by install.sh) holds the locks' versions, nothing else
    but rlpipe itself."""
    import torch

    flavour = ("torch-cpu.txt", "lock-cpu.txt") if torch.__version__.endswith("+cpu") else ("lock-cuda.txt",)
    locked = {n: v for lock in ("tools.txt", *flavour) for n, v in _pins(REQ / lock).items()}
    # The site-packages folders only: setuptools (>= 71), once imported by anything in the session (DeepSpeed's op
    # builds), appends its own _vendor folder to sys.path, whose vendored copies (packaging, zipp …) are no install.
    site = [p for p in sys.path if p.endswith("site-packages")]
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=site)}
    installed.pop("rlpipe", None)
    assert {n: (installed.get(n), v) for n, v in locked.items() if installed.get(n) != v} == {}
    assert sorted(set(installed) - set(locked)) == []


# -- pip's hash-checking mode, offline, against a local one-wheel index ----------------------------------------------
PROBE = "rlpipe-hash-probe"


def _wheel(folder: Path, body: str, requires: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel of PROBE 1.0 whose module holds `body`."""
    mod, dist = PROBE.replace("-", "_"), f"{PROBE.replace('-', '_')}-1.0.dist-info"
    files = {f"{mod}/__init__.py": body,
             f"{dist}/METADATA": "".join(["Metadata-Version: 2.1\n", f"Name: {PROBE}\n", "Version: 1.0\n",
                                          *(f"Requires-Dist: {r}\n" for r in requires)]),
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: rlpipe-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(data.encode())}" for name, data in files.items()]
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{mod}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), data)  # same body, same bytes
    return path


def _offline_env() -> dict[str, str]:
    """No pip config and no index settings: pip sees only what the command names."""
    drop = ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PYTHONPATH")
    return {k: v for k, v in os.environ.items() if k not in drop} | {"PIP_CONFIG_FILE": os.devnull}


def _pip_install(lock: Path, wheels: Path, target: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "install", "--require-hashes", "--no-deps", "--no-index",
                           "--no-cache-dir", "--find-links", str(wheels), "--target", str(target), "-r", str(lock)],
                          capture_output=True, text=True, env=_offline_env(), timeout=120)


def _hashed_lock(tmp_path: Path, wheel: Path) -> Path:
    """A lock pinning PROBE==1.0, hashed by scripts/lock.py from a PEP 503 file:// index serving `wheel`."""
    page = tmp_path / "simple" / PROBE
    page.mkdir(parents=True)
    (page / "index.html").write_text(f'<html><body><a href="{wheel.as_uri()}">{wheel.name}</a></body></html>\n')
    lock = tmp_path / "lock.txt"
    lock.write_text(f"# a lock\n{PROBE}==1.0\n")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "lock.py"), "--no-default-sources",
                          "--index", (tmp_path / "simple").as_uri(), str(lock)],
                         capture_output=True, text=True, env=_offline_env(), timeout=120)
    assert run.returncode == 0, run.stderr
    return lock


def test_pip_installs_the_hashed_file_and_refuses_another(tmp_path):
    wheel = _wheel(tmp_path / "wheels", "X = 1\n")
    lock = _hashed_lock(tmp_path, wheel)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert lock.read_text() == f"# a lock\n{PROBE}==1.0 \\\n    --hash=sha256:{digest}\n"

    ok = _pip_install(lock, tmp_path / "wheels", tmp_path / "ok")
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "ok" / "rlpipe_hash_probe" / "__init__.py").read_text() == "X = 1\n"

    _wheel(tmp_path / "wheels", "X = 2  # not the file the lock hashed\n")  # same name, other content
    bad = _pip_install(lock, tmp_path / "wheels", tmp_path / "bad")
    assert bad.returncode != 0 and "DO NOT MATCH THE HASHES" in bad.stderr, bad.stderr
    assert digest in bad.stderr and not (tmp_path / "bad" / "rlpipe_hash_probe").exists()

    # A pin without a hash beside hashed ones is refused too (hash-checking mode covers the whole file).
    lock.write_text(lock.read_text() + "rlpipe-other-probe==1.0\n")
    _wheel(tmp_path / "wheels", "X = 1\n")
    unhashed = _pip_install(lock, tmp_path / "wheels", tmp_path / "unhashed")
    assert unhashed.returncode != 0 and "rlpipe-other-probe" in unhashed.stderr, unhashed.stderr


def test_lock_py_refuses_a_pin_that_is_not_exact(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text("# a lock\nrlpipe-hash-probe>=1.0\n")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "lock.py"), "--no-default-sources", str(lock)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and f"{lock}:2:" in run.stderr and "rlpipe-hash-probe>=1.0" in run.stderr
    assert lock.read_text() == "# a lock\nrlpipe-hash-probe>=1.0\n"


def test_check_installed_names_a_dependency_the_lock_misses(tmp_path):
    script = ["bash", str(ROOT / "scripts" / "check_installed.sh"), sys.executable]
    clean = subprocess.run(script, capture_output=True, text=True, env=_offline_env(), timeout=120)
    assert clean.returncode == 0, clean.stderr  # this environment, built from the locks

    wheels = tmp_path / "wheels"
    wheel = _wheel(wheels, "X = 1\n", requires=("rlpipe-missing-dependency>=2",))
    lock = tmp_path / "lock.txt"
    lock.write_text(f"{PROBE}==1.0 --hash=sha256:{hashlib.sha256(wheel.read_bytes()).hexdigest()}\n")
    assert _pip_install(lock, wheels, tmp_path / "site").returncode == 0
    broken = subprocess.run(script, capture_output=True, text=True, timeout=120,
                            env=_offline_env() | {"PYTHONPATH": str(tmp_path / "site")})
    assert broken.returncode == 1
    assert f"{PROBE} 1.0 requires rlpipe-missing-dependency" in broken.stderr, broken.stderr
