"""What ds_strategy can do with a DeepSpeed config key, as values the key tables are built from.

A key is *mapped* (its value sets ZeroConfig fields), a *no-op* (accepted; ds_strategy behaves the same whatever
the value, or the key only tunes DeepSpeed's own logging, profiling or IO; a value other than DeepSpeed's default
is listed once in a warning), or *rejected* (a feature ds_strategy does not have; DeepSpeed's default value, or a
value listed as allowed, passes silently, since it asks for nothing). ``honoured`` keys are mapped keys that set
no field because ds_strategy always does what they ask. Each rule carries DeepSpeed's default for the key: it
is what ``"auto"`` means where DeepSpeed's meaning of a key has a default, and the compatibility table shows it.
A mapped rule may also say how the key's value follows from a ZeroConfig (``written_from``): the DeepSpeed writer
(``ds_strategy.config.deepspeed.write``) is that, read over the tables.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
from collections.abc import Callable
from typing import Any, Union

AUTO = "auto"
NO_DEFAULT = "(none)"  # DeepSpeed has no default: the key must be given, or it is a whole section


class Kind(enum.Enum):
    MAPPED = "mapped"
    NO_OP = "no-op"
    REJECTED = "rejected"


Translate = Callable[[str, Any], dict[str, Any]]  # (dotted key, value) -> ZeroConfig fields it sets


@dataclasses.dataclass(frozen=True)
class Rule:
    """What one DeepSpeed key does here; ``note`` says it in words for errors, warnings and the documented table."""

    kind: Kind
    note: str
    default: Any = NO_DEFAULT
    translate: Translate | None = None  # MAPPED only
    quiet: Callable[[Any], bool] | None = None  # NO_OP / REJECTED: values that need no warning / no error
    written_from: Callable[[Any], Any] | None = None  # MAPPED: a ZeroConfig -> this key's value (None: not written)

    def is_quiet(self, value: Any) -> bool:
        if self.quiet is not None:
            return self.quiet(value)
        return value == self.default or value == AUTO


Table = dict[str, Union[Rule, "Table"]]  # a section: key -> rule, or key -> nested section


def field(name: str, default: Any, *, keep_auto: bool = False, written: bool = True) -> Rule:
    """The value is ZeroConfig's ``name``; ``"auto"`` is DeepSpeed's default, or stays "auto" when ZeroConfig
    resolves it from the model (``keep_auto``). The writer writes the field here unless ``written`` is False (a
    deprecated key, whose current one is written instead)."""

    def translate(key: str, value: Any) -> dict[str, Any]:
        if value == AUTO and not keep_auto:
            return {} if default in (NO_DEFAULT, None) else {name: default}
        return {name: value}

    auto = ' ("auto": from the hidden size)' if keep_auto else ""
    written_from = operator.attrgetter(name) if written else None
    return Rule(Kind.MAPPED, f"`ZeroConfig.{name}`{auto}", default, translate, written_from=written_from)


def mapped(note: str, default: Any, translate: Translate, written_from: Callable[[Any], Any] | None = None) -> Rule:
    """``written_from``: how the writer derives the key's value from a ZeroConfig (None: the key is not written)."""
    return Rule(Kind.MAPPED, note, default, translate, written_from=written_from)


def honoured(note: str, default: Any) -> Rule:
    """ds_strategy always behaves as any value of this key asks; no field to set."""
    return Rule(Kind.MAPPED, note, default, lambda key, value: {})


def no_op(default: Any, why: str, quiet: Callable[[Any], bool] | None = None) -> Rule:
    return Rule(Kind.NO_OP, why, default, quiet=quiet)


def no_op_section(why: str) -> Rule:
    """A logging or profiling section: silent unless it turns something on."""
    return no_op(NO_DEFAULT, why, quiet=lambda value: not (isinstance(value, dict) and value.get("enabled")))


def rejected(default: Any, why: str, quiet: Callable[[Any], bool] | None = None) -> Rule:
    """``why`` names what is missing and what to do instead."""
    return Rule(Kind.REJECTED, why, default, quiet=quiet)


def rejected_section(why: str) -> Rule:
    """A feature section: rejected unless empty or ``"enabled": false``."""
    return rejected(
        NO_DEFAULT, why, quiet=lambda value: not value or (isinstance(value, dict) and value.get("enabled") is False)
    )
