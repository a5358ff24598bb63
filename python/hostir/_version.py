"""hostir's version, in one place: the package metadata (pyproject.toml)
reads it from here and `hostir.__version__` is it."""

__version__ = "0.3.0"
