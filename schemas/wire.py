"""One codec for every message class: dataclass fields <-> a wire map.

A message is a frozen dataclass that inherits ``WireMessage`` (encoded and decoded here) or
``ToWire`` (encoded only: the client's ``Request``, whose decoding is its validation, which
names fields and bounds sizes by hand). Three class attributes say what wraps the fields:

- ``VERSION``: written first as ``v`` and checked on decode; None for a nested map (no ``v``).
- ``TYPE``: written after ``v`` as ``type`` and checked on decode; None: no ``type`` key.
- ``WIRE_ORDER``: the key order, when the default below is not it.

Encoding (``to_wire``): ``v``, ``type``, then every field in declaration order, then the
fields declared with ``omit_none()`` in declaration order, each left out while it is None.
Enum members become their string, tuples become lists, nested messages become maps; every
other value is written as it is. The key order is part of the bytes a message packs to, so a
new field goes at the end (tests/unit/schemas/test_wire.py holds the bytes of every message).

Decoding (``from_wire``) is explicit and bounded: the work is one pass over the declared
fields (and the items of typed containers), never a walk of whatever nesting a sender chose;
keys nobody declared are ignored (forward compatibility). A field that is absent or nil
takes its default; a field without a default must be present. A value of the wrong type,
a missing field, a wrong ``v`` or ``type`` raise ``WireFormatError`` (a ``ValueError``)
whose ``field`` names the offending field in dotted form (``parts.2.modality``) — never a
``TypeError``. Scalars are not coerced: an ``int`` field takes an integer (not a bool, not
a string), a ``float`` field takes any number, a ``str`` field a string, an enum field one
of its values. ``Any`` passes a value through untouched; ``list[Any]``/``dict[str, Any]``
check the container and copy it, shallowly.

Nothing happens at import time: a class's codec is built on its first use and cached.
"""

from __future__ import annotations

import dataclasses
import types
from enum import Enum
from typing import Any, Callable, ClassVar, Self, Union, get_args, get_origin, get_type_hints

_OMIT_NONE = "wire.omit_none"

Decoder = Callable[[Any, str], Any]
"""(wire value, dotted field path) -> field value; raises ``WireFormatError``."""
Encoder = Callable[[Any], Any]
"""field value (never None) -> wire value."""


class WireFormatError(ValueError):
    """A map that is not the message it claims to be; ``field`` names the offending field."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def omit_none() -> Any:
    """A field (default None) that is left off the wire map while it is None."""
    return dataclasses.field(default=None, metadata={_OMIT_NONE: True})


class ToWire:
    """Mixin of a message dataclass that is encoded by this codec (see the module doc)."""

    __slots__ = ()
    VERSION: ClassVar[int | None] = None
    TYPE: ClassVar[str | None] = None
    WIRE_ORDER: ClassVar[tuple[str, ...] | None] = None

    def to_wire(self) -> dict[str, Any]:
        return to_wire(self)


class WireMessage(ToWire):
    """Mixin of a message dataclass that is encoded and decoded by this codec."""

    __slots__ = ()

    @classmethod
    def from_wire(cls, m: Any) -> Self:
        """Decode a map; raises ``WireFormatError`` (a ``ValueError``) naming the field."""
        return from_wire(cls, m)


def to_wire(obj: Any) -> dict[str, Any]:
    """The wire map of a message dataclass."""
    plan = _plan(type(obj))
    m: dict[str, Any] = dict(plan.head)
    for f in plan.fields:
        value = getattr(obj, f.name)
        if value is None:
            if not f.omit_none:
                m[f.name] = None
        else:
            m[f.name] = value if f.encode is None else f.encode(value)
    return m


def from_wire(cls: type[Any], m: Any, where: str = "") -> Any:
    """Decode the wire map ``m`` into ``cls``; ``where`` prefixes field paths (nested maps).

    Raises ``WireFormatError`` naming the field when ``m`` is not a valid ``cls``.
    """
    plan = _plan(cls)
    if not isinstance(m, dict):
        raise WireFormatError(f"malformed {plan.name}: expected a map, got {_kind(m)}", where or None)
    for key, want in plan.head:
        got = m.get(key)
        if type(got) is not type(want) or got != want:
            raise WireFormatError(f"malformed {plan.name}: expected {key} {want!r}, got {_show(got)}",
                                  _path(where, key))
    values: dict[str, Any] = {}
    for f in plan.fields:
        raw = m.get(f.name)
        path = _path(where, f.name)
        if raw is None:
            if f.required:
                if f.name not in m:
                    raise WireFormatError(f"malformed {plan.name}: {path} is required", path)
                if not f.nullable:
                    raise WireFormatError(f"malformed {plan.name}: {path} must not be nil", path)
                values[f.name] = None
            continue  # the dataclass default
        values[f.name] = f.decode(raw, path)
    return cls(**values)


# -- the per-class codec, built on first use ---------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Field:
    name: str
    decode: Decoder
    encode: Encoder | None
    """None: the value goes on the wire as it is."""
    omit_none: bool
    required: bool
    """No default: the key must be present."""
    nullable: bool


@dataclasses.dataclass(frozen=True, slots=True)
class _Plan:
    name: str
    head: tuple[tuple[str, Any], ...]
    """``("v", VERSION)`` and ``("type", TYPE)`` when the class has them."""
    fields: tuple[_Field, ...]
    """In wire order."""


_PLANS: dict[type, _Plan] = {}


def _plan(cls: type) -> _Plan:
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = _compile(cls)
    return plan


def _compile(cls: type) -> _Plan:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass")
    hints = get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        fields.append(_Field(f.name, _decoder(tp, cls), _encoder(tp), bool(f.metadata.get(_OMIT_NONE)),
                             required=not has_default, nullable=_nullable(tp)))
    order = getattr(cls, "WIRE_ORDER", None)
    if order is None:
        fields = [f for f in fields if not f.omit_none] + [f for f in fields if f.omit_none]
    else:
        by_name = {f.name: f for f in fields}
        if sorted(order) != sorted(by_name):
            raise TypeError(f"{cls.__name__}.WIRE_ORDER must name every field once")
        fields = [by_name[name] for name in order]
    head = tuple((k, v) for k, v in (("v", getattr(cls, "VERSION", None)), ("type", getattr(cls, "TYPE", None)))
                 if v is not None)
    return _Plan(cls.__name__, head, tuple(fields))


def _nullable(tp: Any) -> bool:
    return tp is Any or (get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp))


def _decoder(tp: Any, owner: type) -> Decoder:
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return lambda v, path: v
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(inner) == len(args):
            raise TypeError(f"{owner.__name__}: only `X | None` unions have a wire codec, not {tp}")
        return _decoder(inner[0], owner)  # None never reaches a decoder
    if tp is bool:
        return _exact(bool, "true or false")
    if tp is int:
        return _integer
    if tp is float:
        return _number
    if tp is str:
        return _exact(str, "a string")
    if tp is bytes:
        return _bytes
    if isinstance(tp, type) and issubclass(tp, Enum):
        return _enum(tp)
    if origin is list:
        return _sequence(_decoder(args[0], owner), args[0] is Any, list)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _sequence(_decoder(args[0], owner), args[0] is Any, tuple)
    if origin is dict:
        return _mapping(args[0], _decoder(args[1], owner), args[1] is Any)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return lambda v, path: from_wire(tp, v, path)
    raise TypeError(f"{owner.__name__}: no wire codec for {tp}")


def _encoder(tp: Any) -> Encoder | None:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return _encoder(next(a for a in args if a is not type(None)))
    if isinstance(tp, type) and issubclass(tp, Enum):
        return str if issubclass(tp, str) else (lambda v: v.value if isinstance(v, Enum) else v)
    if tp is str:  # a StrEnum member in a str field (a built-in modality) goes out as a plain string
        return str
    if origin is tuple:
        inner = _encoder(args[0])
        return list if inner is None else (lambda v: [inner(x) for x in v])
    if origin is list:
        inner = _encoder(args[0])
        return None if inner is None else (lambda v: [inner(x) for x in v])
    if origin is dict:
        inner = _encoder(args[1])
        return None if inner is None else (lambda v: {k: inner(x) for k, x in v.items()})
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return to_wire
    return None


def _exact(kind: type, what: str) -> Decoder:
    def decode(v: Any, path: str) -> Any:
        if not isinstance(v, kind):
            raise WireFormatError(f"{path} must be {what}, got {_kind(v)}", path)
        return v
    return decode


def _integer(v: Any, path: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise WireFormatError(f"{path} must be an integer, got {_kind(v)}", path)
    return v


def _number(v: Any, path: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise WireFormatError(f"{path} must be a number, got {_kind(v)}", path)
    return float(v)


def _bytes(v: Any, path: str) -> bytes:
    if not isinstance(v, (bytes, bytearray)):
        raise WireFormatError(f"{path} must be bytes, got {_kind(v)}", path)
    return bytes(v)


def _enum(kind: type[Enum]) -> Decoder:
    allowed = ", ".join(str(m.value) for m in kind)

    def decode(v: Any, path: str) -> Any:
        if isinstance(v, (str, int)) and not isinstance(v, bool):
            try:
                return kind(v)
            except ValueError:
                pass
        raise WireFormatError(f"{path} must be one of {allowed}, got {_show(v)}", path)
    return decode


def _sequence(item: Decoder, passthrough: bool, make: type) -> Decoder:
    def decode(v: Any, path: str) -> Any:
        if not isinstance(v, (list, tuple)):
            raise WireFormatError(f"{path} must be a list, got {_kind(v)}", path)
        if passthrough:
            return make(v)
        return make(item(x, f"{path}.{i}") for i, x in enumerate(v))
    return decode


def _mapping(key: Any, value: Decoder, passthrough: bool) -> Decoder:
    if key not in (str, Any):
        raise TypeError(f"wire maps are keyed by strings, not {key}")

    def decode(v: Any, path: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise WireFormatError(f"{path} must be a map, got {_kind(v)}", path)
        if key is str:
            for k in v:
                if not isinstance(k, str):
                    raise WireFormatError(f"{path} must be keyed by strings, got a key of {_kind(k)}", path)
        if passthrough:
            return dict(v)
        return {k: value(x, f"{path}.{k}") for k, x in v.items()}
    return decode


def _path(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _kind(v: Any) -> str:
    return "nil" if v is None else type(v).__name__


def _show(v: Any) -> str:
    """A short rendering of a received value, for an error message (never the whole thing)."""
    if isinstance(v, (str, int, float, bool)) or v is None:
        text = repr(v)
        return text if len(text) <= 40 else text[:37] + "..."
    return f"a {_kind(v)}"
