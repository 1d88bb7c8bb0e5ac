"""The values every command takes, checked in one place: each function here is an argparse ``type=``, so a
bad value is refused while the command line is read (one line naming the option), before anything loads.

A temperature is >= 0 (0: greedy), a top-p is in (0, 1], a count (prompts, tokens, turns, layers, a batch)
is a whole number >= 1, a fraction is in [0, 1], a size or a time is a number > 0.
"""

from __future__ import annotations

import argparse
import math


def _number(text: str, what: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}, got {text!r}") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"{what}, got {text!r}")
    return x


def _whole(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}, got {text!r}") from None


def _whole_at_least(text: str, least: int, what: str) -> int:
    n = _whole(text, what)
    if n < least:
        raise argparse.ArgumentTypeError(f"{what}, got {text!r}")
    return n


def count(text: str) -> int:
    """A number of things (prompts, tokens, turns, layers, processes, a batch): a whole number >= 1."""
    return _whole_at_least(text, 1, "takes a whole number >= 1")


def count_or_all(text: str) -> int:
    """A count where 0 means all of them: a whole number >= 0."""
    return _whole_at_least(text, 0, "takes a whole number >= 1 (0: all)")


def whole_number(text: str) -> int:
    """A retry count or a token id: a whole number >= 0."""
    return _whole_at_least(text, 0, "takes a whole number >= 0")


def temperature(text: str) -> float:
    """A sampling temperature: >= 0 (0: greedy decoding)."""
    what = "takes a temperature >= 0 (0: greedy)"
    t = _number(text, what)
    if t < 0:
        raise argparse.ArgumentTypeError(f"{what}, got {text!r}")
    return t


def temperatures(text: str) -> list[float]:
    """Distinct temperatures separated by commas (e.g. 0,1), each >= 0."""
    what = "takes distinct temperatures >= 0 separated by commas (e.g. 0,1)"
    parts = [t for t in text.split(",") if t.strip()]
    try:
        temps = [temperature(t) for t in parts]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{what}, got {text!r}") from None
    if not temps or len(set(temps)) != len(temps):
        raise argparse.ArgumentTypeError(f"{what}, got {text!r}")
    return temps


def top_p(text: str) -> float:
    """A nucleus-sampling threshold: in (0, 1] (1: the whole distribution)."""
    what = "takes a nucleus threshold above 0 and at most 1"
    p = _number(text, what)
    if not 0 < p <= 1:
        raise argparse.ArgumentTypeError(f"{what}, got {text!r}")
    return p


def fraction(text: str) -> float:
    """A share of something: in [0, 1]."""
    what = "takes a fraction from 0 to 1"
    f = _number(text, what)
    if not 0 <= f <= 1:
        raise argparse.ArgumentTypeError(f"{what}, got {text!r}")
    return f


def positive(text: str) -> float:
    """A size or a time: a number > 0."""
    what = "takes a number > 0"
    x = _number(text, what)
    if x <= 0:
        raise argparse.ArgumentTypeError(f"{what}, got {text!r}")
    return x


def tree_budget(text: str) -> int | None:
    """--tree-budget: a node budget >= 0 (0: the chain) or auto (None)."""
    if text == "auto":
        return None
    what = "takes a node budget, a whole number >= 0 (0: the chain), or auto"
    n = _whole(text, what)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{what}, got {text!r}")
    return n
