#!/usr/bin/env bash
# The native scanner's fuzzer, then every input it kept replayed through the scanner built under
# AddressSanitizer and UBSan (gcc): any out-of-bounds access or undefined behaviour aborts with a
# report. (Coverage feedback does not work with the sanitizers preloaded, so the search runs on the
# normal build.) Arguments go to the search run of fuzz_native.py.
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
mkdir "$work/corpus"
cd "$root"
python3 benchmarks/fuzz_native.py "$@" "$work/corpus"
echo "replaying $(ls "$work/corpus" | wc -l) inputs under ASan + UBSan"
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  PYTHONPATH="$work" python3 benchmarks/fuzz_native.py -runs=0 "$work/corpus"
