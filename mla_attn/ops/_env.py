"""The kernels' environment switches (``docs/switches.md``), read once at import and checked.

A value outside a switch's choices raises ValueError naming the variable, the value and the choices, so that
``MLA_ATTN_GLUON=false`` or ``MLA_ATTN_DECODE_SPLIT_TAIL=on`` never leaves a kernel silently as it was. An unset or
empty variable takes the switch's default.
"""

from __future__ import annotations

import math
import os

ON_OFF = ("0", "1")
AUTO_ON_OFF = ("auto", "0", "1")


def _raw(name: str) -> str:
    return os.environ.get(name, "").strip()


def choice(name: str, default: str, choices: tuple[str, ...] = ON_OFF) -> str:
    """The variable's value, one of ``choices`` (``default`` when unset or empty)."""
    value = _raw(name)
    if value == "":
        return default
    if value not in choices:
        raise ValueError(f"environment variable {name}={value!r}: expected one of {', '.join(choices)} "
                         f"(or unset: {default or 'the default rule'})")
    return value


def flag(name: str, default: bool) -> bool:
    """An on / off switch: ``1`` on, ``0`` off."""
    return choice(name, "1" if default else "0") == "1"


def tristate(name: str, default: bool | None, none: str = "") -> bool | None:
    """``1`` True, ``0`` False, ``none`` (the empty string: unset) None, a rule decided per call."""
    values = {"1": True, "0": False, none: None}
    unset = {True: "1", False: "0", None: none}[default]
    return values[choice(name, unset, tuple(k for k in values if k))]


def auto_or_count(name: str) -> str:
    """``auto`` (the default) or a whole number, as a string."""
    value = _raw(name)
    if value == "":
        return "auto"
    if value != "auto" and not value.isdigit():
        raise ValueError(f"environment variable {name}={value!r}: expected auto or a whole number (or unset: auto)")
    return value


def number(name: str, default: float) -> float:
    """A finite number >= 0."""
    value = _raw(name)
    if value == "":
        return default
    try:
        x = float(value)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and x >= 0):
        raise ValueError(f"environment variable {name}={value!r}: expected a finite number >= 0 "
                         f"(or unset: {default:g})")
    return x
