"""
The input checks every edge shares. A value that comes from outside (a setting, a config
file, a checkpoint, an API request) is checked once, where it arrives, by require(); a
refusal is an InputError (BadValue, a ValueError; BadType, a TypeError), which a script's
command line prints as one line (configurator.run_cli) and a bug never raises.

    require(top_p > 0, f"top_p must be in (0, 1], got {top_p!r}")
    require(is_int(n), f"n must be an int, got {n!r}", TypeError)
    require_field(self, "block_size", is_int(self.block_size), "an int >= 1")   # a field
"""
import math
import numbers


class InputError(Exception):
    """a mistake in what came from outside (a setting, a config file, a path, a request),
    not a bug: on a script's command line its message is printed alone
    (configurator.run_cli). Raised
    as BadValue or BadType, a ValueError and a TypeError"""


class BadValue(InputError, ValueError):
    pass


class BadType(InputError, TypeError):
    pass


def require(ok, message, error=ValueError):
    """raise error(message) unless ok, as an InputError (ValueError: BadValue, TypeError:
    BadType): one line per input rule"""
    if not ok:
        raise INPUT_ERRORS.get(error, error)(message)


INPUT_ERRORS = {ValueError: BadValue, TypeError: BadType}


def require_field(obj, name, ok, expected, error=ValueError):
    """require() for a config's field: the message names the class, the field, what it
    must be and what it is"""
    require(ok, f"{type(obj).__name__}.{name} must be {expected}, got {getattr(obj, name)!r}",
            error)


def is_int(x):
    """an int (a numpy integer too: numbers.Integral), never a bool"""
    # plain ints first: prompts check every token, and the ABC's check is slower
    return type(x) is int or isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_number(x):
    """an int or a float, never a bool (NaN and inf included: compare to refuse them)"""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_finite_number(x):
    """an int or a float that is finite, never a bool"""
    return is_number(x) and math.isfinite(x)
