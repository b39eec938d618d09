#!/usr/bin/env bash
# Build both native modules (nereus_comm._C, nereus_rl._native) with AddressSanitizer and
# UBSan and run the native-facing tests under them.
#
# The build goes into a copy of the working tree (tracked and untracked, not ignored
# files), never over the in-place modules other processes use; pytest runs in that copy
# with it first on PYTHONPATH. Python itself is not instrumented, so libasan is
# preloaded (LD_PRELOAD, with libstdc++); child processes the tests start inherit it. Any ASan or UBSan
# report ends the process with an error, so a clean exit means none was found.
#
# Usage: scripts/sanitize.sh [extra pytest arguments]
# Environment:
#   NEREUS_SANITIZE_DIR  where the copy lives (default: $TMPDIR/nereus-sanitize-$UID). It is
#                        kept between runs, so a rerun rebuilds only what changed.
#   CMAKE_BUILD_PARALLEL_LEVEL  build jobs (default: all CPUs).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="${NEREUS_SANITIZE_DIR:-${TMPDIR:-/tmp}/nereus-sanitize-$(id -u)}"
mkdir -p "$work"
start=$(date +%s)

# The copy: tar keeps modification times, so an unchanged source is not rebuilt.
cd "$root"
git ls-files -z -co --exclude-standard |
  tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$work"

echo "== building with -fsanitize=address,undefined in $work"
(cd "$work" && NEREUS_SANITIZE=1 python setup.py -q build_ext --inplace >"$work/build.log" 2>&1) || {
  tail -n 40 "$work/build.log"
  exit 1
}
built=$(date +%s)

# libstdc++ is preloaded too: python does not link it, and ASan resolves the real
# __cxa_throw when it starts, so without it the first C++ exception aborts.
libasan="$(${CXX:-g++} -print-file-name=libasan.so)"
libstdcxx="$(${CXX:-g++} -print-file-name=libstdc++.so.6)"
if [[ ! -e "$libasan" || ! -e "$libstdcxx" ]]; then
  echo "libasan.so or libstdc++.so.6 not found (asked ${CXX:-g++}); install its ASan runtime" >&2
  exit 1
fi

tests=(
  tests/comm/test_pack.py
  tests/comm/test_remap.py
  tests/comm/test_layout.py
  tests/comm/test_page_moves.py
  tests/comm/test_transport_net.py
  tests/comm/test_public_api.py
  tests/comm/test_fuzz_pack.py
  tests/comm/test_fuzz_remap.py
  tests/comm/test_sharded_planner.py
  tests/rl/test_native_bindings.py
  tests/rl/planner/test_planner_native.py
  tests/rl/transition/test_transition_native.py
)
echo "== running ${#tests[@]} test files under ASan + UBSan"
cd "$work"
# detect_leaks=0: CPython and torch keep allocations alive until exit by design.
status=0
env PYTHONPATH="$work${PYTHONPATH:+:$PYTHONPATH}" \
  LD_PRELOAD="$libasan:$libstdcxx" \
  ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:verify_asan_link_order=0:${ASAN_OPTIONS:-}" \
  UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}" \
  python -m pytest -q -p no:cacheprovider "${tests[@]}" "$@" || status=$?
done_at=$(date +%s)
echo "== sanitize: build $((built - start)) s, tests $((done_at - built)) s, exit $status"
exit $status
