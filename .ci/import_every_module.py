"""Import every module of the installed ds_strategy, as a user's virtual environment holds it, and account for each
one that does not import.

    python .ci/import_every_module.py [REFUSING_MODULE ...]

Run by ``.ci/installed_package`` from a directory outside the clone, in a virtual environment into which the built
wheel was installed (not editable). It checks, and exits 1 saying what went otherwise:

- ``ds_strategy`` comes from that environment's site-packages, not from the clone;
- the installed files are the clone's tracked sources, one for one (``kernels/`` and ``configs/`` installed as
  ``ds_strategy.kernels`` and ``ds_strategy.configs``, the YAML presets with them): nothing was left out of the wheel
  and nothing stray went in;
- every module found in the installed package (walked on disk with pkgutil, private ones too) imports, except each
  REFUSING_MODULE and the modules under it, which must fail with ds_strategy's own error
  (``optional_packages.needs``): ModuleNotFoundError naming the refusing module, a package that really is not
  installed here, and the pip command that installs it. Each REFUSING_MODULE itself must fail so.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import pkgutil
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

CLONE = Path(__file__).resolve().parents[1]
# the clone's folders that install under another name (setup.py's REMAPPED)
INSTALLED_AS = {"ds_strategy": "ds_strategy", "kernels": "ds_strategy/kernels", "configs": "ds_strategy/configs"}
REFUSAL = re.compile(
    r"^(?P<refusing>\S+) needs the optional package '(?P<package>[\w.]+)', which is not installed[^:]*: "
    r"pip install (?P<install>'[^']+'(?: '[^']+')*)$"
)


def installed_package() -> Path:
    """The installed ds_strategy folder, checked to be in this environment's site-packages."""
    spec = importlib.util.find_spec("ds_strategy")
    if spec is None or spec.origin is None:
        sys.exit("ds_strategy is not installed in this environment")
    folder = Path(spec.origin).resolve().parent
    site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()
    if CLONE in folder.parents or site_packages not in folder.parents:
        sys.exit(f"ds_strategy is imported from {folder}, not from this environment's {site_packages}")
    return folder


def file_differences(folder: Path) -> list[str]:
    """The clone's tracked files of the package that are not installed, and installed files the clone lacks."""
    tracked = subprocess.run(
        ["git", "-C", str(CLONE), "ls-files", *INSTALLED_AS], capture_output=True, text=True, check=True
    ).stdout.split()
    expected = set()
    for path in tracked:
        top, _, rest = path.partition("/")
        expected.add(f"{INSTALLED_AS[top]}/{rest}")
    installed = {
        f"ds_strategy/{path.relative_to(folder).as_posix()}"
        for path in folder.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    return [f"not installed: {p}" for p in sorted(expected - installed)] + [
        f"installed, not in the clone: {p}" for p in sorted(installed - expected)
    ]


def modules(folder: Path, package: str = "ds_strategy") -> list[str]:
    """Every module and package under ``folder``, found on disk (walking by import would stop at a refusal)."""
    found = [package]
    for info in pkgutil.iter_modules([str(folder)]):
        name = f"{package}.{info.name}"
        found += modules(folder / info.name, name) if info.ispkg else [name]
    return found


def _under(module: str, refusing: str) -> bool:
    return module == refusing or module.startswith(refusing + ".")


def account(names: list[str], refusing: set[str]) -> tuple[list[str], dict[str, str], list[str]]:
    """Import each module: ``([imported], {refused module: its error}, [what went otherwise])``."""
    imported, refused, wrong = [], {}, []
    for name in names:
        expected = next((r for r in sorted(refusing, key=len, reverse=True) if _under(name, r)), None)
        try:
            importlib.import_module(name)
        except Exception as error:  # every failure is accounted for below
            message = str(error)
            match = REFUSAL.match(message)
            clear = (
                isinstance(error, ModuleNotFoundError)
                and match is not None
                and importlib.util.find_spec(match["package"]) is None
                and any(_under(name, r) and match["refusing"] == r for r in refusing)
            )
            if expected is None or not clear:
                wrong.append(f"{name}: {type(error).__name__}: {message}")
            else:
                refused[name] = message
            continue
        imported.append(name)
        # a module under a refusing package may import when its parent's failed import left it in sys.modules
        if name == expected:
            wrong.append(f"{name} imported, but should refuse: its package is expected to be missing here")
    return imported, refused, wrong


def main(refusing: list[str]) -> int:
    folder = installed_package()
    differences = file_differences(folder)
    names = modules(folder)
    unknown = [r for r in refusing if r not in names]
    imported, refused, wrong = account(names, set(refusing))
    version = importlib.metadata.version("ds-strategy")
    print(f"ds_strategy {version} from {folder}: {len(names)} modules, {len(imported)} import, {len(refused)} refuse")
    for name in refusing:
        print(f"  refuses as expected: {refused.get(name, '(did not refuse)')}")
    problems = differences + [f"{r}: no such module" for r in unknown] + wrong
    for problem in problems:
        print(f"  FAILED {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
