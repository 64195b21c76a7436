"""The packages only some of ds_strategy needs, and the error a user without one of them gets.

The core imports none of them (``tests/architecture/test_optional_packages.py`` proves it with each one hidden). A
module whose whole purpose is one (the Accelerate adapter, the Hydra configs, the Triton kernels, ...) imports it under
``needs``, so that a machine without the package fails at that import saying what to install, not with a bare ``No
module named ...`` from some line inside.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

# the pyproject extra that installs each package (a package not listed is installed by its own name)
EXTRAS = {
    "accelerate": "accelerate",
    "hydra": "hydra",
    "lightning": "lightning",
    "lightning_utilities": "lightning",
    "omegaconf": "hydra",
    "pytorch_lightning": "lightning",
    "transformers": "transformers",
    "triton": "triton",
}


@contextlib.contextmanager
def needs(*packages: str, needed_by: str, extra: str | None = None) -> Iterator[None]:
    """Imports in this block that fail because one of ``packages`` is not installed raise ModuleNotFoundError naming
    it, ``needed_by`` and the pip command that installs it (``ds-strategy[extra]`` when the block names the extra
    that brings all of them, else the missing package's own); any other import error passes unchanged (a submodule
    missing from an installed package, say of another version, is not a missing package)."""
    try:
        yield
    except ModuleNotFoundError as error:
        package = (error.name or "").partition(".")[0]
        if package not in packages or importlib.util.find_spec(package) is not None:
            raise
        extra = extra or EXTRAS.get(package)
        install = f"ds-strategy[{extra}]" if extra else package
        raise ModuleNotFoundError(
            f"{needed_by} needs the optional package {package!r}, which is not installed: pip install '{install}'",
            name=package,
        ) from error
