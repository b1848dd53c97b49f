"""Argument checks shared by every layer, one rule per kind of argument: an out-of-range or
mistyped argument is an `InvalidArgumentError` (a `SessionError` and a `ValueError`) raised before
anything is asked of Redis, never a bare `TypeError` from deep inside."""

from __future__ import annotations

from .errors import InvalidArgumentError

MAX_N = 2**53 - 1
"""The largest n (or count) an argument may name: an exact integer in JSON (I-JSON, as the gateway
takes it), far below a stream ID's 64 bits."""

MAX_TTL = float(2**53 // 1000)
"""The longest ttl in seconds (its milliseconds stay an exact integer: ~285 000 years)."""


def shown(value: object, limit: int = 80) -> str:
    """`value` as an error message shows it: its repr cut to `limit` characters, or its type's name
    when its repr raises (the caller's own exception must not replace the typed error)."""
    try:
        text = repr(value)
    except Exception:
        return f"<{type(value).__name__} object>"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def is_int(value: object, *, minimum: int = 0, maximum: int = MAX_N) -> bool:
    """An int (not a bool) in [minimum, maximum]."""
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= maximum


def check_int(value: object, what: str, *, minimum: int = 0, maximum: int = MAX_N) -> int:
    if not is_int(value, minimum=minimum, maximum=maximum):
        raise InvalidArgumentError(f"{what} must be an int in [{minimum}, {maximum}], got {shown(value)}")
    assert isinstance(value, int)
    return value


def check_optional_int(value: object, what: str, *, minimum: int = 0, maximum: int = MAX_N) -> int | None:
    if value is None:
        return None
    if not is_int(value, minimum=minimum, maximum=maximum):
        raise InvalidArgumentError(f"{what} must be None or an int in [{minimum}, {maximum}], got {shown(value)}")
    assert isinstance(value, int)
    return value


def check_seconds(value: object, what: str, *, maximum: float = MAX_TTL, zero: bool = False) -> float:
    """A positive number of seconds (int or float, not a bool) up to `maximum` (`zero`: or 0)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (0 <= value if zero else 0 < value)
        or not value <= maximum
    ):
        least = "a non-negative" if zero else "a positive"
        raise InvalidArgumentError(f"{what} must be {least} number of seconds up to {maximum:.0f}, got {shown(value)}")
    return float(value)


def check_incarnation(value: object) -> str | None:
    """A life pin: None (any life) or the incarnation string a header gave."""
    if value is not None and (not isinstance(value, str) or not value or len(value) > 64):
        raise InvalidArgumentError(f"incarnation must be None or a header's incarnation string, got {shown(value)}")
    return value
