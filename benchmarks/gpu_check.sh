#!/usr/bin/env bash
# One full check on a GPU machine, from the source tree (no install): the routes (`ferry info`), the
# test suite, and the given bench groups. benchmarks/gpu_memcheck.sh runs the CUDA tests under memcheck.
# Usage: benchmarks/gpu_check.sh OUTDIR [BENCH_GROUPS] [PYTEST_ARGS...]
set -u
out=${1:?output folder}; groups=${2:-handoff,latency,peer}; shift $(( $# > 1 ? 2 : 1 ))
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvidia-smi topo -m; } >"$out/machine.txt" 2>&1
timeout 60 python3 -m ferry info >>"$out/machine.txt" 2>&1
timeout 360 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=60 -rs --durations=12 "$@" >"$out/pytest.log" 2>&1
echo "pytest rc=$?" >>"$out/pytest.log"; tail -3 "$out/pytest.log"
if [ -n "$groups" ]; then
  timeout 300 python3 -X faulthandler -m ferry bench --quick --groups "$groups" --out "$out/bench" >"$out/bench.log" 2>&1
  echo "bench rc=$?" >>"$out/bench.log"; tail -40 "$out/bench.log"
fi
