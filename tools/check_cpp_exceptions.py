"""What a torch C++ extension built here can do at run time: format an
error message (c10::str over std::ostringstream, with strings, an integer, a
shape) and raise it into Python (a global exception translator set up at
module init, GIL released; std::runtime_error). It also records the
compiler used, the one torch was built with and the libstdc++ loaded.

Builds one small extension (torch.utils.cpp_extension.load_inline, the
compiler torch picks, as for hostir._C) and runs each case in a fresh
process with torch's C++ stack trace on a fatal signal, so a crash in one is
reported (exit status and the native frames) instead of ending the check.

Run: PYTHONPATH=python python3 tools/check_cpp_exceptions.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

SOURCE = r"""
#include <torch/extension.h>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

namespace {
struct OwnError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
PyObject* error_class = nullptr;

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const OwnError& e) {
    PyErr_SetString(error_class, e.what());
  }
}

std::string format(const std::string& what, const at::Tensor& t) {
  if (what == "strings") return c10::str("value ", std::string("T0"), " is not bound");
  if (what == "integer") return c10::str("T0 has ", static_cast<size_t>(1), " dims");
  if (what == "shape") return c10::str("its tensor has shape ", t.sizes());
  std::ostringstream ss;
  ss << int64_t{42};
  return ss.str();
}

void work(const std::string& what) {
  if (what == "own") throw OwnError("own error");
  if (what == "runtime") throw std::runtime_error("runtime error");
}

void run(const std::string& what) {
  pybind11::gil_scoped_release r;
  work(what);
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  if (std::getenv("CHECK_TRANSLATOR")) {
    error_class = pybind11::module_::import("hostir.runtime.evaluator").attr("BindingError").ptr();
    Py_INCREF(error_class);
    pybind11::register_exception_translator(&translate);
  }
  m.def("format", &format);
  m.def("run", &run);
}
"""

# name: (environment, Python statement run with the extension as `ext`)
CASES = {
    "c10::str of strings": ({}, "print(ext.format('strings', torch.ones(1)))"),
    "std::ostringstream << int64_t": ({}, "print(ext.format('ostream', torch.ones(1)))"),
    "c10::str with an integer": ({}, "print(ext.format('integer', torch.ones(1)))"),
    "c10::str with a shape": ({}, "print(ext.format('shape', torch.ones(2, 2)))"),
    "own error, global translator set up at init, GIL released": ({"CHECK_TRANSLATOR": "1"}, "ext.run('own')"),
    "std::runtime_error, GIL released": ({}, "ext.run('runtime')"),
}


def build(directory: str):
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        "hostir_check_exceptions", cpp_sources=[SOURCE], build_directory=directory, extra_cflags=["-O2", "-g0"]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--build-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        import torch

        from hostir.runtime.evaluator import BindingError

        torch._C._set_print_stack_traces_on_fatal_signal(True)

        sys.path.insert(0, args.build_dir)
        import hostir_check_exceptions as ext  # noqa: F401

        try:
            exec(CASES[args.case][1], {"ext": ext, "torch": torch, "BindingError": BindingError})
        except BaseException as err:  # noqa: BLE001 - report what came out
            print(f"raised {type(err).__module__}.{type(err).__name__}: {err}")
        return 0

    import torch

    directory = tempfile.mkdtemp(prefix="hostir-check-exceptions-")
    build(directory)
    results = {"torch": torch.__version__, "cases": {}}
    header = os.path.join(os.path.dirname(torch.__file__), "include", "pybind11", "detail", "common.h")
    with open(header) as f:
        results["torch_pybind11"] = ".".join(
            line.split()[2] for line in f if line.startswith(("#define PYBIND11_VERSION_MAJOR",
                                                               "#define PYBIND11_VERSION_MINOR",
                                                               "#define PYBIND11_VERSION_PATCH"))
        )
    cxx = os.environ.get("CXX", "c++")
    results["compiler"] = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    results["torch_built_with"] = [
        line.strip() for line in torch.__config__.show().splitlines() if "GCC" in line or "C++ Version" in line
    ]
    with open("/proc/self/maps") as f:
        results["libstdcxx_loaded"] = sorted({line.split()[-1] for line in f if "libstdc++" in line})
    for key, value in results.items():
        print(f"{key}: {value}")
    for name, (env, _) in CASES.items():
        proc = subprocess.run(
            [sys.executable, __file__, "--case", name, "--build-dir", directory],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        outcome = proc.stdout.strip() if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr.strip()[-1500:]}"
        results["cases"][name] = {"rc": proc.returncode, "outcome": outcome}
        print(f"{name}: {outcome}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
