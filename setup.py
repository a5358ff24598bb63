"""Installs the hostir package from python/hostir."""

from setuptools import find_packages, setup

setup(
    name="hostir",
    version="0.2.0",
    description="A Host-IR runtime: tensor programs pipelined across CUDA streams and devices",
    package_dir={"": "python"},
    packages=find_packages("python"),
    python_requires=">=3.11",
    install_requires=["torch>=2.11"],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100"],
        # tools/bench_overlap.py plots its M sweep when matplotlib is there.
        "bench": ["matplotlib>=3.7"],
    },
)
