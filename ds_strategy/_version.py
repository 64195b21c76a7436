"""The package's version, written once: pyproject.toml reads it (a dynamic version) and ``ds_strategy.__version__``,
``ds-strategy --version`` and the wheel's metadata all show it."""

__version__ = "0.1.0"
