"""A wire form for frozen dataclasses, read off their annotations: one codec for every typed
protocol message of the daemon (`wire/executor_ops/`).

A message is a frozen dataclass, with an `op` tag (a `ClassVar`) when it travels alone. Its
wire form is the JSON object `{"op": op, field: value, …}`:

- a field without a default is always there (null where its type allows None);
- a field with a default is left out while it holds that default (and, where the protocol
  is canonical, refused when sent holding it: each message has one wire form);
- a nested value is the object of its own fields (with its `op` where it is a message, as
  `Ready.estimate` is); a tuple is a list.

Decoding checks every field against its annotation: an `int` is an int and never a bool, a
`float` takes an int, a `str` a string, a `tuple[X, ...]` a list of X, a `dict[str, X]` an object
of X; a union takes its dataclass arm for an object (the one its `op` names where there are
several), else the first other arm that fits; a field that is not the type's, an unknown field,
or a missing field without a default is refused with a ValueError naming the message and the
field. So `from_wire(type(m), to_wire(m), …) == m` for every message, and `to_wire` of what
decodes is what was sent.

It is written on the standard library rather than on a serialization library (msgspec, which
vLLM uses, or pydantic) because the executor side runs in the job's own interpreter (any venv,
any framework), which has the standard library and torch and nothing else we may assume. Each
type's fields are read once; a message costs a few microseconds each way, less than the JSON
around it (`bench/executor_codec.py`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, Union

Wire = dict[str, Any]

_MISSING: Any = object()
Check = Callable[[Any, str], Any]  # (value, what holds it) -> the value decoded


class _Wrong(Exception):
    """A value that is not of a field's type (the field's check says what it should be)."""


def _kind(hint: Any) -> tuple[Check, str]:
    """How to check a value against the annotation `hint`, and what it should be (in words).
    A check raises `_Wrong`, or (inside a nested object) a ValueError that names the field."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return (lambda v, what: v), "anything"
    if hint in _SCALARS:
        return _exact(hint), _SCALARS[hint]
    if hint is float:
        def number(v: Any, what: str) -> float:
            if type(v) is float:
                return v
            if type(v) is int:
                return float(v)
            raise _Wrong
        return number, "a number"
    if origin in (Union, types.UnionType):
        return _union(args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item, want = _kind(args[0])

        def sequence(v: Any, what: str) -> tuple[Any, ...]:
            if type(v) is not list:
                raise _Wrong
            return tuple(item(x, what) for x in v)
        return sequence, f"a list of {_plural(want)}"
    if origin is dict and args and args[0] is str:
        value, want = _kind(args[1])

        def mapping(v: Any, what: str) -> dict[str, Any]:
            if type(v) is not dict:
                raise _Wrong
            return {k: value(x, what) for k, x in v.items()}
        return mapping, "an object" if args[1] is Any else f"an object of {_plural(want)}"
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        def nested(v: Any, what: str) -> Any:
            if type(v) is not dict:
                raise _Wrong
            return _spec(hint).decode(v, what, True)
        return nested, "an object"
    raise TypeError(f"no wire form for {hint!r}")


_SCALARS: dict[Any, str] = {type(None): "null", bool: "true or false", int: "an int",
                            str: "a string"}


def _exact(cls: type) -> Check:
    def check(v: Any, what: str) -> Any:
        if type(v) is not cls:
            raise _Wrong
        return v
    return check


def _union(args: tuple[Any, ...]) -> tuple[Check, str]:
    """A union: an object is decoded as its one dataclass arm (or the arm its `op` names), any
    other value as the first of the other arms that takes it."""
    nested = {getattr(a, "op", a.__name__): _kind(a)[0] for a in args
              if isinstance(a, type) and dataclasses.is_dataclass(a)}
    plain = [_kind(a) for a in args if not (isinstance(a, type) and dataclasses.is_dataclass(a))]

    def check(v: Any, what: str) -> Any:
        if nested and type(v) is dict:
            if len(nested) == 1:
                return next(iter(nested.values()))(v, what)
            op = v.get("op")
            if type(op) is not str or op not in nested:
                raise ValueError(f"{what}: field 'op' must be one of "
                                 f"{sorted(nested)}, got {op!r:.100}")
            return nested[op](v, what)
        for arm, _ in plain:
            try:
                return arm(v, what)
            except _Wrong:
                continue
        raise _Wrong
    wants = [w for _, w in plain] + (["an object"] if nested else [])
    return check, " or ".join(wants)


def _plural(what: str) -> str:
    return {"an int": "ints", "a string": "strings", "a number": "numbers"}.get(what, what)


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    default: Any  # _MISSING: none
    check: Check
    want: str
    scalar: type | None  # int, str, bool or float: checked inline
    nullable: bool  # with `scalar`: or null
    convert: bool  # its value is encoded by `_value` (it holds a message or a tuple)


def _field(f: dataclasses.Field[Any], hint: Any) -> _Field:
    check, want = _kind(hint)
    default = (f.default if f.default is not dataclasses.MISSING else
               f.default_factory() if f.default_factory is not dataclasses.MISSING else _MISSING)
    if default is None and want.startswith("null or "):
        want = f"{want.removeprefix('null or ')}, or left out"
    # Objects of plain values and `Any` payloads go as they are (JSON writes them); a nested
    # message becomes its object and a tuple a list, so that what decodes encodes back equal.
    convert = _holds(hint, lambda h: typing.get_origin(h) is tuple or (
        isinstance(h, type) and dataclasses.is_dataclass(h)))
    arms = [a for a in typing.get_args(hint) if a is not type(None)]
    nullable = len(arms) == 1 and type(None) in typing.get_args(hint)
    scalar = arms[0] if nullable else hint
    if scalar not in (int, str, bool, float):
        scalar, nullable = None, False
    return _Field(f.name, default, check, want, scalar, nullable, convert)


class _Spec:
    """One message type's fields, read once from its annotations."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.op: str | None = getattr(cls, "op", None)
        hints = typing.get_type_hints(cls)
        self.fields = tuple(_field(f, hints[f.name]) for f in dataclasses.fields(cls))
        self.keys = frozenset(f.name for f in self.fields) | ({"op"} if self.op else set())
        self.encode = self._encoder()
        self.decode = self._decoder()

    def _encoder(self) -> Callable[[Any], Wire]:
        """`encode` for this type, written out field by field (as `dataclasses` writes a
        type's `__init__`): a message is encoded on every iteration, and a loop over the
        fields cost about ten times as much."""
        names: dict[str, Any] = {"_value": _value}
        lines = ["def encode(msg):", f"    out = {{'op': {self.op!r}}}" if self.op else
                 "    out = {}"]
        for i, f in enumerate(self.fields):
            value = "_value(v)" if f.convert else "v"
            lines.append(f"    v = msg.{f.name}")
            if f.default is _MISSING:
                lines.append(f"    out[{f.name!r}] = {value}")
            else:
                names[f"default{i}"] = f.default
                lines.append(f"    if not (v == default{i}): out[{f.name!r}] = {value}")
        lines.append("    return out")
        exec("\n".join(lines), names)  # noqa: S102 - the source is built from field names
        encode: Callable[[Any], Wire] = names["encode"]
        return encode

    def _decoder(self) -> Callable[[Wire, str, bool], Any]:
        """`decode` for this type, written out field by field like `encode`: an int, str,
        bool or float (or one of them or null) is checked inline, anything else by its
        field's check."""
        names: dict[str, Any] = {"cls": self.cls, "keys": self.keys, "MISSING": _MISSING,
                                 "Wrong": _Wrong, "unknown": _unknown, "missing": _missing,
                                 "wrong": _wrong, "held": _held}
        lines = ["def decode(d, what, canonical):",
                 "    if not d.keys() <= keys:", "        raise unknown(what, d, keys)",
                 "    kw = {}"]
        for i, f in enumerate(self.fields):
            names[f"want{i}"], names[f"check{i}"] = f.want, f.check
            lines += [f"    v = d.get({f.name!r}, MISSING)", "    if v is MISSING:",
                      f"        raise missing(what, {f.name!r}, want{i})"
                      if f.default is _MISSING else "        pass", "    else:"]
            lines += [f"        {line}" for line in _inline_check(f, i)]
            if f.default is not _MISSING:
                names[f"default{i}"] = f.default
                lines += [f"        if canonical and v == default{i}:",
                          f"            raise held(what, {f.name!r}, default{i})"]
            lines.append(f"        kw[{f.name!r}] = v")
        lines.append("    return cls(**kw)")
        exec("\n".join(lines), names)  # noqa: S102 - the source is built from field names
        decode: Callable[[Wire, str, bool], Any] = names["decode"]
        return decode


def _inline_check(f: _Field, i: int) -> list[str]:
    """The lines that check (and convert) field `f`'s value `v` in a generated decoder."""
    raise_wrong = f"raise wrong(what, {f.name!r}, want{i}, v)"
    if f.scalar is None:
        return ["try:", f"    v = check{i}(v, what + {': ' + f.name!r})", "except Wrong:",
                f"    {raise_wrong} from None"]
    wrong = f"type(v) is not {f.scalar.__name__}" + (" and v is not None" if f.nullable else "")
    if f.scalar is not float:
        return [f"if {wrong}:", f"    {raise_wrong}"]
    return ["if type(v) is int:", "    v = float(v)", f"elif {wrong}:", f"    {raise_wrong}"]


def _unknown(what: str, d: Wire, keys: frozenset[str]) -> ValueError:
    return ValueError(f"{what}: unknown field(s) {sorted(set(d) - keys)}; it has "
                      f"{sorted(keys)}")


def _missing(what: str, name: str, want: str) -> ValueError:
    return ValueError(f"{what}: field {name!r} is missing ({want})")


def _wrong(what: str, name: str, want: str, v: Any) -> ValueError:
    return ValueError(f"{what}: field {name!r} must be {want}, got {v!r:.100}")


def _held(what: str, name: str, default: Any) -> ValueError:
    # one wire form per message: a field holding its default is left out
    return ValueError(f"{what}: field {name!r} is left out, not sent, when it is {default!r}")


def _holds(hint: Any, test: Callable[[Any], bool]) -> bool:
    """Whether `hint` or a type inside it passes `test`."""
    return test(hint) or any(_holds(a, test) for a in typing.get_args(hint))


def _value(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return _spec(type(v)).encode(v)
    if isinstance(v, tuple):
        return [_value(x) for x in v]
    if isinstance(v, dict):
        return {k: _value(x) for k, x in v.items()}
    return v


_SPECS: dict[type, _Spec] = {}


def _spec(cls: type) -> _Spec:
    spec = _SPECS.get(cls)
    if spec is None:
        spec = _SPECS[cls] = _Spec(cls)
    return spec


def to_wire(msg: Any) -> Wire:
    """The wire dict of the dataclass `msg`."""
    return _spec(type(msg)).encode(msg)


def from_wire(cls: type, d: Wire, what: str, *, canonical: bool = True) -> Any:
    """The `cls` that `d` is; `what` names it in errors ("executor message 'run'").
    `canonical` False takes a field sent holding its default (a protocol of many clients)."""
    return _spec(cls).decode(d, what, canonical)
