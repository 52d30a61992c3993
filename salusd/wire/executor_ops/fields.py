"""The field checks every decoder of the executor protocol uses: each takes the message dict,
what it is (for the error) and the key, and returns the value of the type it names or raises
ValueError saying which field is wrong and why. `maybe_*`: the key may be left out; `*_or_none`:
it must be there and may be null."""

from __future__ import annotations

from typing import Any

from salus.daemon.wire.executor_ops.messages import Wire

MISSING: Any = object()


def bad(what: str, key: str, want: str, got: Any) -> ValueError:
    if got is MISSING:
        return ValueError(f"executor message {what}: field {key!r} is missing ({want})")
    return ValueError(f"executor message {what}: field {key!r} must be {want}, got "
                      f"{got!r:.100}")


def only(d: Wire, what: str, keys: frozenset[str]) -> None:
    if not d.keys() <= keys:
        unknown = sorted(set(d) - keys)
        raise ValueError(f"executor message {what}: unknown field(s) {unknown}; it has "
                         f"{sorted(keys)}")


def integer(d: Wire, what: str, key: str) -> int:
    v = d.get(key, MISSING)
    if type(v) is int:
        return v
    raise bad(what, key, "an int", v)


def integer_or_none(d: Wire, what: str, key: str) -> int | None:
    v = d.get(key, MISSING)
    if v is None or type(v) is int:
        return v
    raise bad(what, key, "an int or null", v)


def maybe_integer(d: Wire, what: str, key: str) -> int | None:
    """An int when the key is there; None when it is left out."""
    v = d.get(key, MISSING)
    if v is MISSING or type(v) is int:
        return None if v is MISSING else v
    raise bad(what, key, "an int, or left out", v)


def number(d: Wire, what: str, key: str) -> float:
    v = d.get(key, MISSING)
    if type(v) is float:
        return v
    if type(v) is int:
        return float(v)
    raise bad(what, key, "a number", v)


def maybe_number(d: Wire, what: str, key: str) -> float | None:
    v = d.get(key, MISSING)
    if type(v) is float:
        return v
    if v is MISSING:
        return None
    if type(v) is int:
        return float(v)
    raise bad(what, key, "a number, or left out", v)


def boolean(d: Wire, what: str, key: str) -> bool:
    v = d.get(key, MISSING)
    if type(v) is bool:
        return v
    raise bad(what, key, "true or false", v)


def maybe_boolean(d: Wire, what: str, key: str) -> bool | None:
    v = d.get(key, MISSING)
    if v is MISSING or type(v) is bool:
        return None if v is MISSING else v
    raise bad(what, key, "true or false, or left out", v)


def text(d: Wire, what: str, key: str) -> str:
    v = d.get(key, MISSING)
    if type(v) is str:
        return v
    raise bad(what, key, "a string", v)


def text_or_none(d: Wire, what: str, key: str) -> str | None:
    v = d.get(key, MISSING)
    if v is None or type(v) is str:
        return v
    raise bad(what, key, "a string or null", v)


def maybe_text(d: Wire, what: str, key: str) -> str | None:
    v = d.get(key, MISSING)
    if v is MISSING or type(v) is str:
        return None if v is MISSING else v
    raise bad(what, key, "a string, or left out", v)


def maybe_dict(d: Wire, what: str, key: str) -> dict[str, Any] | None:
    v = d.get(key, MISSING)
    if v is MISSING or type(v) is dict:
        return None if v is MISSING else v
    raise bad(what, key, "an object, or left out", v)


def nested(d: Wire, what: str, key: str, *, null: bool) -> Wire | None:
    v = d.get(key, MISSING)
    if type(v) is dict or (null and v is None):
        return v
    raise bad(what, key, "an object or null" if null else "an object", v)


def true(d: Wire, what: str, key: str) -> None:
    if d.get(key, MISSING) is not True:
        raise bad(what, key, "true", d.get(key, MISSING))


def false(d: Wire, what: str, key: str) -> None:
    if d.get(key, MISSING) is not False:
        raise bad(what, key, "false", d.get(key, MISSING))
