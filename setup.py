"""Builds hostir. The package's metadata (name, version, dependencies,
extras, entry points) lives in pyproject.toml; this file is for the build
steps that need code."""

from setuptools import setup

setup()
