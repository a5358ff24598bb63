"""Builds hostir's C++ executor,
`hostir._C`, from csrc/host_ir against the installed torch.

The extension needs torch at build time: install torch first and build with
`pip install --no-build-isolation -e .` (pip's build isolation would fetch
another torch into a throwaway environment). Without torch in the build
environment, or with HOSTIR_NO_EXTENSION=1, the package installs without the
extension and runs on the Python evaluator.
"""

import glob
import os
import sys

from setuptools import setup


def _extension():
    if os.environ.get("HOSTIR_NO_EXTENSION") == "1":
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print(
            "hostir: torch is not importable at build time, so hostir._C is not built; "
            "install torch first and use pip install --no-build-isolation",
            file=sys.stderr,
        )
        return [], {}
    # The executor's sources, its transports in csrc/host_ir/transports/ included.
    sources = sorted(glob.glob(os.path.join("csrc", "host_ir", "**", "*.cpp"), recursive=True))
    ext = CppExtension(
        name="hostir._C",
        sources=sources,
        # No debug info: it doubles the compile and link time of torch's headers.
        extra_compile_args=["-O2", "-g0"],
        # The copy-engine transport opens libcuda with dlopen (older glibc
        # keeps it in libdl).
        libraries=["dl"],
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extension()

# Name, version, dependencies, extras and entry points live in
# pyproject.toml; this file adds the build step that needs code.
setup(
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
