"""Checks at the door: every value a person passes in is checked where it enters.

``EngineConfig``, ``SamplingParams`` and ``LLMEngine.add_request`` use these helpers, so a
bad value raises at once, naming the field and the value, before any state changes: a
``TypeError`` for a value of the wrong kind (``seed="3"``), a ``ValueError`` for one of the
right kind but out of range (``temperature=nan``). Integer-like values (numpy or torch
integers) are converted to plain ``int``; ``True``/``False`` never count as numbers.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Optional

# torch.Generator.manual_seed takes 0 <= seed < 2**64 (a negative seed wraps around).
MAX_SEED = 2**64 - 1


def label(owner: str, name: str) -> str:
    return f"{owner}.{name}" if owner else name


def as_int(owner: str, name: str, value: Any, low: Optional[int] = None, high: Optional[int] = None,
           *, optional: bool = False, where: str = "", rng: Optional[str] = None) -> Optional[int]:
    """``value`` as a plain int in ``[low, high]`` (None allowed when ``optional``)."""
    if value is None and optional:
        return None
    rng = rng if rng is not None else _range_words(low, high)
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("torch.bool", "bool"):
        raise TypeError(f"{label(owner, name)}={value!r}{where}: must be an integer{rng}"
                        f"{' or None' if optional else ''}")
    try:
        v = operator.index(value)        # int, numpy and torch integers; not float, str, bool arrays
    except TypeError:
        raise TypeError(f"{label(owner, name)}={value!r}{where}: must be an integer{rng}"
                        f"{' or None' if optional else ''}") from None
    if (low is not None and v < low) or (high is not None and v > high):
        raise ValueError(f"{label(owner, name)}={value!r}{where}: must be an integer{rng}"
                         f"{' or None' if optional else ''}")
    return int(v)


def as_real(owner: str, name: str, value: Any, low: Optional[float] = None, high: Optional[float] = None,
            *, low_open: bool = False, high_open: bool = False, optional: bool = False,
            where: str = "") -> Optional[float]:
    """``value`` as a finite float between ``low`` and ``high`` (open ends when asked)."""
    if value is None and optional:
        return None
    lo = "(" if low_open else "["
    hi = ")" if high_open else "]"
    rng = f" in {lo}{low if low is not None else '-inf'}, {high if high is not None else 'inf'}{hi}"
    if low is not None and high is None:
        rng = f" {'>' if low_open else '>='} {low}"
    want = f"must be a finite number{rng if low is not None or high is not None else ''}" \
           f"{' or None' if optional else ''}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{label(owner, name)}={value!r}{where}: {want}")
    v = float(value)
    if not math.isfinite(v) or (low is not None and (v <= low if low_open else v < low)) \
            or (high is not None and (v >= high if high_open else v > high)):
        raise ValueError(f"{label(owner, name)}={value!r}{where}: {want}")
    return v


def as_bool(owner: str, name: str, value: Any, where: str = "") -> bool:
    """``True`` or ``False`` (a numpy bool too); not a string, a number or None."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise TypeError(f"{label(owner, name)}={value!r}{where}: must be True or False")


def as_seed(owner: str, name: str, value: Any, *, optional: bool = False, where: str = "") -> Optional[int]:
    """A seed ``torch.Generator.manual_seed`` takes as it is: an integer in [0, 2**64)."""
    return as_int(owner, name, value, 0, MAX_SEED, optional=optional, where=where, rng=" in [0, 2**64)")


def _range_words(low: Optional[int], high: Optional[int]) -> str:
    if low is not None and high is not None:
        return f" in [{low}, {high}]"
    if low is not None:
        return f" >= {low}"
    if high is not None:
        return f" <= {high}"
    return ""
