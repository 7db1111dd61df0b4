"""
Input checks where outside input arrives (a config, an API call, an HTTP request, a
checkpoint): one helper that raises a ValueError (or TypeError) naming the bad value,
and the type tests the boundaries share. Internal calls trust their callers (an assert
states an invariant).

    require(top_p > 0, f"top_p must be in (0, 1], got {top_p!r}")
    require(is_int(n), f"n must be an int, got {n!r}", TypeError)
"""

import math

import numpy as np


def require(ok, message, error=ValueError):
    """Raise error(message) unless ok: one line per input rule."""
    if not ok:
        raise error(message)


def require_field(obj, name, ok, expected, error=ValueError):
    """require() for a config's field: the message names the class, the field, what it
    must be and what it is."""
    if not ok:
        raise error(f"{type(obj).__name__}.{name} must be {expected}, "
                    f"got {getattr(obj, name)!r}")


def is_int(x):
    """An int (a numpy integer too), never a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def is_number(x):
    """An int or a float, never a bool (NaN and inf included: compare to refuse them)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_finite_number(x):
    """An int or a float that is finite, never a bool."""
    return is_number(x) and math.isfinite(x)
