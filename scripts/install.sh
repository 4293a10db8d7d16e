#!/usr/bin/env bash
# Creates (once) the shared dependency venv, and this clone's own `.venv`.
#
# The heavy dependencies live in one venv outside the clone, keyed by the dependency pins, so a
# fresh clone (CI) reuses it and a change of pins builds a new one. It never holds rlpipe itself.
# `.venv` is a small venv of this clone's own: a .pth file puts the shared site-packages on its
# path, rlpipe (with flows and tasks) is installed editable from this clone, and the dependencies'
# console scripts are copied into .venv/bin with their shebang pointing at .venv/bin/python, so
# they too import this clone's code. Clones share the dependencies, never the project: deleting or
# changing one clone breaks no other.
#
#   scripts/install.sh               build what is missing (a repeat call checks and returns)
#   scripts/install.sh --venv-path   print the shared venv's path for these pins; build nothing
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=cuda; else flavour=cpu; fi
# Bump recipe when the steps below change in a way that needs a rebuild of the shared venv.
recipe=1
# The locks this flavour installs (all in hash-checking mode: docs/install.md); the key covers all of them.
if [ "$flavour" = cpu ]; then locks="requirements/torch-cpu.txt requirements/lock-cpu.txt"; else locks=requirements/lock-cuda.txt; fi
key=$( { echo "$recipe"; cat requirements/base.in requirements/tools.txt $locks; } | sha256sum | cut -c1-16)
cache=${RLPIPE_VENV_CACHE:-$HOME/.cache/rlpipe}
venv="$cache/venv-$flavour-$key"
py=${PYTHON:-python3}
if [ "${1:-}" = --venv-path ]; then echo "$venv"; exit 0; fi

# pip prints a warning per package for missing local index folders on some machines: hide those.
pipq() { "$@" 2>&1 | { grep -v "^WARNING: Location '" || true; }; return "${PIPESTATUS[0]}"; }

# System packages, installed when missing and we are root (else a warning says what is lost).
# RLPIPE_NO_SYSTEM_PACKAGES=1 skips them (tests that install clones).
#   apt_install PACKAGE WHAT-FAILS-WITHOUT-IT [APT-OPTION]
apt_install() {
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[install] apt-get install $1"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ${3:+"$3"} "$1") >/dev/null 2>&1 \
      || echo "[install] WARNING: could not install $1; $2"
  else
    echo "[install] WARNING: $1 is missing and this is not root with apt-get; $2"
  fi
}
if [ "${RLPIPE_NO_SYSTEM_PACKAGES:-0}" != 1 ]; then
  # bubblewrap for the code sandbox (libseccomp2 ships with Debian).
  command -v bwrap >/dev/null 2>&1 || apt_install bubblewrap "the sandbox runs at a weaker isolation level"
  # Debian's chromium for the report's browser test (Playwright drives it; `playwright install` would
  # download a browser). Only `make test` asks for it (RLPIPE_INSTALL_BROWSER=1): the demo needs none.
  if [ "${RLPIPE_INSTALL_BROWSER:-0}" = 1 ] && [ ! -x /usr/bin/chromium ]; then
    apt_install chromium "the report's browser test (tests/tracking/test_report.py) fails until it is installed"
  fi
  # promtool, from Debian's prometheus package, for the alert rules' checks and unit tests
  # (tests/infra/test_monitoring.py). Only `make test` asks for it (RLPIPE_INSTALL_TEST_TOOLS=1).
  if [ "${RLPIPE_INSTALL_TEST_TOOLS:-0}" = 1 ] && ! command -v promtool >/dev/null 2>&1; then
    apt_install prometheus "the Prometheus rule tests (tests/infra/test_monitoring.py) skip until promtool is installed" \
      --no-install-recommends
    # Where systemd runs, the package also enables and starts a Prometheus server on every interface
    # (port 9090): the tests need promtool only.
    if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
      systemctl disable --now prometheus >/dev/null 2>&1 || true
    fi
  fi
  # Debian's prometheus-pushgateway, which the run-metrics push tests start on a loopback port
  # (tests/tracking/test_prom_push.py, tests/flows/test_run_metrics_push.py). Only `make test` asks for it.
  if [ "${RLPIPE_INSTALL_TEST_TOOLS:-0}" = 1 ] && ! command -v prometheus-pushgateway >/dev/null 2>&1; then
    apt_install prometheus-pushgateway "the Pushgateway tests skip until it is installed" --no-install-recommends
    # Where systemd runs, the package also enables and starts a gateway on every interface (port 9091).
    if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
      systemctl disable --now prometheus-pushgateway >/dev/null 2>&1 || true
    fi
  fi
fi

build_shared() {
  echo "[install] building $venv ($flavour) — a few minutes, once per set of pins"
  local start
  start=$(date +%s)
  rm -rf "$venv"
  "$py" -m venv "$venv"
  # Hash-checking mode for every install: a file whose sha256 the lock does not list is refused, and so
  # is any package the locks do not pin. --no-deps: the locks are the whole tree, nothing else comes
  # in; check_installed.sh then checks that nothing is missing from it.
  local pipi=("$venv/bin/pip" install -q --require-hashes --no-deps)
  # pip itself, and the setuptools that builds deepspeed (an sdist only) without build isolation: pip
  # would fetch an isolated build's own setuptools without checking any hash.
  pipq "${pipi[@]}" -r requirements/tools.txt
  local lock=requirements/lock-cuda.txt
  if [ "$flavour" = cpu ]; then
    # torch first and alone (its CPU build comes from a wheel folder or the PyTorch CPU index).
    pipq "${pipi[@]}" -r requirements/torch-cpu.txt
    lock=requirements/lock-cpu.txt
  fi
  pipq "${pipi[@]}" --only-binary=:all: --no-binary=deepspeed --no-build-isolation -r "$lock"
  bash scripts/check_installed.sh "$venv/bin/python"
  "$venv/bin/python" -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') else f'torch {v} replaced 2.13.0')"
  touch "$venv/.complete"
  echo "[install] done in $(( $(date +%s) - start )) s"
}

mkdir -p "$cache"
(
  # One clone at a time builds or changes the shared venv; the others wait for it.
  if command -v flock >/dev/null 2>&1; then flock 9; fi
  if [ ! -f "$venv/.complete" ]; then build_shared; fi
  # Older versions of this script installed the clone editable *into* the shared venv: every clone
  # then imported whichever clone ran `make` last. Take that install out.
  if compgen -G "$venv/lib/python3*/site-packages/rlpipe-*.dist-info" >/dev/null; then
    echo "[install] removing the rlpipe install an older install.sh left in $venv"
    pipq "$venv/bin/pip" uninstall -q -y rlpipe \
      || echo "[install] WARNING: could not uninstall it; clones still import their own rlpipe first"
  fi
) 9>"$cache/.lock"

# This clone's venv is current when it was made for this shared venv, this clone's path and this
# pyproject.toml (entry points, packages); then there is nothing to do.
stamp="$venv $root $(sha256sum pyproject.toml | cut -c1-16)"
current=$(cat .venv/.rlpipe-install 2>/dev/null || true)
if [ -d .venv ] && [ ! -L .venv ] && [ "$current" = "$stamp" ] && [ -x .venv/bin/rlpipe ]; then exit 0; fi
if [ -d .venv ] && [ ! -L .venv ] && [ ! -e .venv/.rlpipe-managed ]; then
  echo "[install] $root/.venv is a venv this script did not make; move it away and run make install again" >&2
  exit 1
fi
echo "[install] making $root/.venv (dependencies from $venv)"
rm -rf .venv  # a symlink (older layout: the shared venv itself) or an outdated venv of ours
# Made by the shared venv's python, so on the same base interpreter.
"$venv/bin/python" -m venv --without-pip .venv
touch .venv/.rlpipe-managed
"$venv/bin/python" - "$venv" "$root/.venv" <<'PY'
"""Put the shared site-packages on .venv's path; copy the shared console scripts into .venv/bin."""
import os
import shlex
import sys
import sysconfig

shared, clone = sys.argv[1:]
purelib = sysconfig.get_path("purelib")  # this (the shared venv's) python's site-packages
rel = os.path.relpath(purelib, sys.prefix)
# addsitedir, not a plain path line: the shared site-packages' own .pth files must run too.
with open(os.path.join(clone, rel, "_rlpipe_shared_deps.pth"), "w") as fh:
    fh.write(f"import site; site.addsitedir({purelib!r})\n")

python = os.path.join(clone, "bin", "python")
shebang = f"#!{python}" if len(python) < 120 and " " not in python else (
    f"#!/bin/sh\n'''exec' {shlex.quote(python)} \"$0\" \"$@\"\n' '''")  # pip's form for long paths
shared_bin, clone_bin = os.path.join(shared, "bin"), os.path.join(clone, "bin")
for name in sorted(os.listdir(shared_bin)):
    src, dst = os.path.join(shared_bin, name), os.path.join(clone_bin, name)
    if name == "rlpipe" or name.startswith("activate") or os.path.lexists(dst) or not os.path.isfile(src):
        continue  # python*, activate*: the clone's own; rlpipe: installed from this clone below
    with open(src, "rb") as fh:
        data = fh.read()
    lines = data.split(b"\n", 3)
    if lines[0].startswith(b"#!" + shared_bin.encode() + b"/python"):
        body = b"\n".join(lines[1:])
    elif data.startswith(b"#!/bin/sh\n'''exec' ") and len(lines) == 4 and shared_bin.encode() in lines[1]:
        body = lines[3]  # pip's three-line header for long paths
    else:
        os.symlink(src, dst)  # a binary (weed, ninja) or a script that does not name the python
        continue
    with open(dst, "wb") as fh:
        fh.write(shebang.encode() + b"\n" + body)
    os.chmod(dst, 0o755)
PY
# This clone, editable, into its own venv (pip and setuptools come from the shared venv).
pipq .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e . > .venv/.editable.log \
  || { cat .venv/.editable.log; echo "[install] editable install of $root failed"; exit 1; }
echo "$stamp" > .venv/.rlpipe-install
