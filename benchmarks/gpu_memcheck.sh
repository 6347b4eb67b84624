#!/usr/bin/env bash
# The suite's CUDA tests under compute-sanitizer's memcheck, from the source tree, on a GPU machine.
# Usage: benchmarks/gpu_memcheck.sh OUTDIR [WORKERS [PYTEST_ARGS...]]   (test files come after WORKERS)
# Runs every test but the emulated-device cases and those that load the stand-in driver (a sanitizer
# attaches to the real driver only) in one pytest process under the sanitizer. Child interpreters the tests
# start (the CLI, the examples, the loader's workers) run unchecked (MEMCHECK_TARGETS, default
# application-only): checked, each pays the sanitizer's start-up and the CLI tests outrun their timeouts.
# WORKERS (default 0) spreads the tests over that many xdist processes, which are then checked too
# (the default becomes MEMCHECK_TARGETS=all); workers start slowly under the sanitizer, so this is slower on a 16-core host.
# Writes OUTDIR/memcheck.log (every checked process's report, concatenated) and OUTDIR/pytest.log, and
# prints the error summaries: a clean run reads "ERROR SUMMARY: 0 errors" for each.
# Driver calls that fail on purpose (the tests that exhaust device memory) are not reported as errors
# (--report-api-errors no): the summaries count memory errors. A process stopped before its end writes no
# report, so MEMCHECK_LIMIT=SECONDS bounds the run the other way: tests not started MEMCHECK_RESERVE seconds
# (default 120) before the limit are skipped (tests/conftest.py reads MEMCHECK_DEADLINE), every process ends and reports,
# and the run is interrupted at the limit only if that did not suffice. The script says how many tests the
# budget skipped. Five tests are left out because the sanitizer, not ferry, decides them: three interpreter-exit
# tests whose subject is a child interpreter (unchecked by default; checked, it outruns the tests' timeouts),
# the AddressSanitizer build of the core (its runtime must load first), and the GPU-fault test (its kernel
# faults on purpose, which memcheck reports). On an H200 VM the whole selection takes about 7.5 minutes; pass
# test files to run it in parts.
# Exit status: pytest's, or 1 where a report counts errors (a -k of your own replaces "not emulated").
set -u
out=${1:?output folder}; workers=${2:-0}; shift $(( $# > 1 ? 2 : 1 ))
mkdir -p "$out"; logs=$(mktemp -d)
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
[ -n "$sanitizer" ] || { echo "compute-sanitizer not found" >&2; exit 2; }
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
xdist=(); targets=application-only; [ "$workers" -gt 0 ] && { xdist=(-n "$workers"); targets=all; }
if [ -n "${MEMCHECK_LIMIT:-}" ]; then export MEMCHECK_DEADLINE=$(( $(date +%s) + MEMCHECK_LIMIT - ${MEMCHECK_RESERVE:-120} )); fi
${MEMCHECK_LIMIT:+timeout -s INT -k 30 $MEMCHECK_LIMIT} "$sanitizer" --tool memcheck --report-api-errors no --target-processes "${MEMCHECK_TARGETS:-$targets}" --log-file "$logs/%p.log" \
  python3 -m pytest -q -rs -p no:cacheprovider "${xdist[@]}" -o faulthandler_timeout=300 --durations=10 \
  -k "not emulated" --ignore tests/test_packaging.py --ignore tests/test_stand_in_driver.py \
  --ignore tests/test_loader_stand_in.py --ignore tests/test_trees_stand_in.py \
  --deselect tests/test_native_review.py::test_the_stand_in_drivers_counts_hold_under_parallel_calls \
  --deselect tests/test_loader_hot.py::test_on_the_cuda_backend_a_slot_batch_makes_no_device_allocation_once_batches_were_dropped \
  --deselect tests/test_process.py::test_interpreter_exit_with_transfers_in_flight_is_clean \
  --deselect tests/test_waits.py::test_exit_waits_for_transfers_in_flight_without_starting_a_thread \
  --deselect tests/test_waits.py::test_exit_with_a_held_stream_is_bounded_and_warns \
  --deselect tests/test_native_core.py::test_the_core_has_no_memory_error_under_addresssanitizer \
  --deselect tests/test_gpu_faults.py::test_a_faulting_producer_fails_the_next_transfer_and_every_call_after \
  "$@" >"$out/pytest.log" 2>&1
rc=$?
cat "$logs"/*.log >"$out/memcheck.log" 2>/dev/null
echo "pytest rc=$rc"; tail -1 "$out/pytest.log"
echo "skipped for the time budget: $(awk -F'[][]' '/^SKIPPED/ && /memcheck time budget/ {s += $2} END {print s + 0}' "$out/pytest.log")"
echo "processes: $(ls "$logs" | wc -l)"; grep -h "ERROR SUMMARY" "$out/memcheck.log" | sort | uniq -c
rm -rf "$logs"
if grep -h "ERROR SUMMARY" "$out/memcheck.log" | grep -qv "ERROR SUMMARY: 0 errors"; then exit 1; fi
exit $rc
