#!/usr/bin/env bash
# Build the GoogleTest tests of csrc/host_ir against the installed torch and
# GoogleTest (Debian's libgtest-dev, or GTEST_ROOT with include/ and lib/),
# then run them. Usage: bash tests/cpp/run.sh [build dir]
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-build/tests_cpp}"
mkdir -p "$out"
python="${PYTHON:-python3}"
read -r torch_flags torch_libs < <("$python" - <<'PY'
import torch
from torch.utils import cpp_extension as ce
inc = " ".join(f"-I{p}" for p in ce.include_paths())
abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
libs = " ".join(f"-L{p} -Wl,-rpath,{p}" for p in ce.library_paths())
print(f"{inc} -D_GLIBCXX_USE_CXX11_ABI={abi}", libs)
PY
)
gtest_flags=""
if [[ -n "${GTEST_ROOT:-}" ]]; then
  gtest_flags="-I$GTEST_ROOT/include -L$GTEST_ROOT/lib"
fi
std="-std=c++17"
if "$python" -c 'import sys, torch; sys.exit(0 if tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 13) else 1)'; then
  std="-std=c++20"
fi
# The executor's sources (every .cpp of csrc/host_ir but the Python
# bindings), each as its object from `setup.py build_ext` when that is newer
# than the source and every header (a translation unit with torch's headers
# takes a minute or more on a small machine), else as the source.
headers=(csrc/host_ir/*.h csrc/host_ir/*/*.h)
core=()
for src in $(find csrc/host_ir -name '*.cpp' ! -name bindings.cpp | sort); do
  use="$src"
  for obj in build/temp*/"${src%.cpp}.o"; do
    fresh=1
    for dep in "$src" "${headers[@]}"; do
      if [[ ! -f "$obj" || ! "$obj" -nt "$dep" ]]; then
        fresh=0
      fi
    done
    if [[ $fresh == 1 ]]; then
      use="$obj"
    fi
  done
  core+=("$use")
done
echo "tests/cpp: core from ${core[*]}"
# shellcheck disable=SC2086
g++ $std -O1 -fPIC $torch_flags $gtest_flags \
  "${core[@]}" tests/cpp/test_executor.cpp \
  -o "$out/test_executor" \
  $torch_libs -ltorch -ltorch_cpu -lc10 -lgtest -lgtest_main -pthread -ldl
"$out/test_executor"
