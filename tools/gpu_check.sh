#!/usr/bin/env bash
# The GPU check (tools/gpu_check.py): on a lent GPU, `bash tools/gpu_check.sh`; the CPU
# rehearsal, `bash tools/gpu_check.sh --smoke --out /tmp/rehearsal`. Runs jattn from this
# working tree, with the machine's own python3 (jax, torch, pytest already there).
set -uo pipefail
cd "$(dirname "$0")/.."
exec env PYTHONPATH="$PWD" XLA_PYTHON_CLIENT_PREALLOCATE=false python3 tools/gpu_check.py "$@"
