"""The one part of the build pyproject.toml cannot say: which packages the wheel holds.

Note: [Where each package comes from]
Every folder with an ``__init__.py`` under ``ds_strategy/`` is found, so a new subpackage cannot be left out of the
wheel (a hand-kept list once left out ``ds_strategy.compose``, and the built wheel did not import). Two trees live
outside that folder and install under it: the Triton kernels in ``kernels/`` install as ``ds_strategy.kernels`` (a
top-level ``kernels`` package belongs to another project on PyPI), and the YAML presets in ``configs/`` as
``ds_strategy.configs``, where Hydra finds them as ``pkg://ds_strategy.configs``. ``[tool.setuptools.packages.find]``
cannot rename what it finds, so the finding is done here; ``.ci/run`` builds the wheel, installs it outside the
clone and imports every module of it.
"""

from setuptools import find_namespace_packages, find_packages, setup

REMAPPED = {"ds_strategy.kernels": "kernels", "ds_strategy.configs": "configs"}


def packages() -> list[str]:
    """``ds_strategy`` and its subpackages, then each remapped tree, whose folders of data only (the Accelerate
    presets in ``configs/accelerate/``) count too: their files travel as package data."""
    found = find_packages(include=["ds_strategy", "ds_strategy.*"])
    for package, folder in REMAPPED.items():
        inside = find_namespace_packages(folder, exclude=["__pycache__", "*.__pycache__"])
        found += [package, *(f"{package}.{sub}" for sub in inside)]
    return found


setup(packages=packages(), package_dir=REMAPPED)
