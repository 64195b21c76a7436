"""The packages only some of ds_strategy needs, and the error a user without one of them gets.

The core imports none of them (``tests/architecture/test_optional_packages.py`` proves it with each one hidden). A
module whose whole purpose is one (the Accelerate adapter, the Hydra configs, the Triton kernels, ...) imports it under
``needs``, so that a machine without the package fails at that import saying what to install, not with a bare ``No
module named ...`` from some line inside.

Note: [The install command a missing package names]
ds-strategy is not on the package index yet, so ``pip install "ds-strategy[lightning]"`` fails wherever it is run.
What works from anywhere is installing the extra's own requirements, which are on the index: the error names those
(``pip install 'lightning>=2.5'``), read from this installation's metadata so that they are the pins pyproject.toml
declares, whether ds_strategy was installed from a clone (``pip install -e``) or from a built wheel.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import re
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
DISTRIBUTION = "ds-strategy"


def extra_requirements(extra: str) -> list[str]:
    """The requirements ``ds-strategy[extra]`` adds, as pyproject.toml declares them (``["lightning>=2.5"]``); empty
    when ds_strategy runs without installed metadata."""
    try:
        declared = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    marker = re.compile(rf"""extra\s*==\s*["']{re.escape(extra)}["']""")
    return [
        requirement.strip()
        for requirement, _, condition in (line.partition(";") for line in declared)
        if marker.search(condition) and not requirement.startswith(DISTRIBUTION)
    ]


def install_command(package: str, extra: str | None) -> str:
    """The pip command that installs ``package`` today (Note: [The install command a missing package names])."""
    requirements = (extra_requirements(extra) if extra else []) or [package]
    return "pip install " + " ".join(f"'{requirement}'" for requirement in requirements)


@contextlib.contextmanager
def needs(*packages: str, needed_by: str, extra: str | None = None) -> Iterator[None]:
    """Imports in this block that fail because one of ``packages`` is not installed raise ModuleNotFoundError naming
    it, ``needed_by`` and the pip command that installs it (the requirements of ``extra`` when the block names the
    extra that brings all of them, else of the missing package's own extra, else the package by its name); any other
    import error passes unchanged (a submodule missing from an installed package, say of another version, is not a
    missing package)."""
    try:
        yield
    except ModuleNotFoundError as error:
        package = (error.name or "").partition(".")[0]
        if package not in packages or importlib.util.find_spec(package) is not None:
            raise
        extra = extra or EXTRAS.get(package)
        brings = f" (ds-strategy's [{extra}] extra)" if extra and extra_requirements(extra) else ""
        raise ModuleNotFoundError(
            f"{needed_by} needs the optional package {package!r}, which is not installed{brings}: "
            f"{install_command(package, extra)}",
            name=package,
        ) from error
