"""The ``ds-strategy`` command: one subcommand per module in this package.

Each subcommand module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``; the
dispatcher finds them by name, so adding a command means adding a module.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from .._version import __version__


def _subcommands() -> dict[str, object]:
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            found[info.name.replace("_", "-")] = importlib.import_module(f"{__name__}.{info.name}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ds-strategy", description="ZeRO for PyTorch Lightning, Fabric and Accelerate"
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = _subcommands()
    for name, module in sorted(commands.items()):
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.HELP))
    args = parser.parse_args(argv)
    return commands[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
