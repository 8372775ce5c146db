#!/usr/bin/env bash
# The native scanner's fuzzer with the scanner built under AddressSanitizer and UBSan (gcc): any
# out-of-bounds access or undefined behaviour aborts with a report. Arguments go to fuzz_native.py.
#   bash benchmarks/fuzz_native_asan.sh -max_total_time=600
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp -r "$root/traceinspect" "$work/"
rm -f "$work"/traceinspect/load/_kineto_scan*.so
suffix="$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
gcc -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined -shared -fPIC \
  $(python3-config --includes) "$root/traceinspect/load/_kineto_scan.c" -o "$work/traceinspect/load/_kineto_scan$suffix"
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export PYTHONPATH="$work"
cd "$root"
python3 benchmarks/fuzz_native.py "$@"
