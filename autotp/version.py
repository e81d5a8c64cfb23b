"""autotp's version (pyproject.toml states it too), in a module of its own so that the ranks'
agreement check reads it without importing the package's entry points."""
__version__ = "0.1.0"
