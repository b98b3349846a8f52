"""The building blocks of the settings sections: ``setting`` (a field with its default, what it
trades off and its constraints), the frozen ``Section`` base, and the value sets the code acts on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Literal, TypeVar, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

T = TypeVar("T")


ENV_PREFIX = "MMSTREAM_"

# The value sets below are the ones the code acts on; tests check each against its user
# (the partitioner strategies, the engines' precisions), since this package imports nothing.
EnginePrecision = Literal["fp32", "fp16", "bf16", "int8"]
ENGINE_PRECISIONS: tuple[str, ...] = get_args(EnginePrecision)
"""Precision variants an ONNX engine can serve (the repository must hold the variant)."""
LmPrecision = Literal["fp32", "int8"]
GeneratorPrecision = Literal["q4_1", "fp32", "int8"]
"""The LM variants: q4_1 is the packaged GGUF on llama.cpp, fp32 and int8 the ONNX exports."""
"""The LM and Whisper engines serve fp32 or int8 weights."""
Partitioner = Literal["least-loaded", "spread", "hash", "round-robin"]
Scheduler = Literal["continuous", "static"]
SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN", "OAUTHBEARER"]
Grouping = Literal["length", "fifo"]
QueueOrder = Literal["fair", "arrival"]
TASKS = ("embed", "generate", "retrieve")


def _check_bootstrap(value: str) -> str:
    servers = [s.strip() for s in value.split(",")]
    for server in servers:
        host, sep, port = server.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"{server!r} is not host:port")
    return ",".join(servers)


Bootstrap = Annotated[str, AfterValidator(_check_bootstrap)]
UserPath = Annotated[Path, AfterValidator(lambda p: p.expanduser())]


def csv_items(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def parse_assignments(value: str | Iterable[str], parse: Callable[[str], T], form: str) -> dict[str, T]:
    """The one parser of ``name=value`` lists (a comma-separated string, or items one by one):
    {name: parse(value)}, both stripped. Raises ``ValueError`` saying "'<item>' is not
    <form>" for an item with no ``=`` or no name, or whose value ``parse`` refuses by raising
    ``ValueError``."""
    items = csv_items(value) if isinstance(value, str) else [v.strip() for v in value]
    out: dict[str, T] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        try:
            if not sep or not name.strip():
                raise ValueError(item)
            out[name.strip()] = parse(raw.strip())
        except ValueError:
            raise ValueError(f"{item!r} is not {form}") from None
    return out


def whole_number(raw: str, least: int = 0) -> int:
    """``raw`` as a whole number of at least ``least``; raises ``ValueError``."""
    if not raw.isdigit() or int(raw) < least:
        raise ValueError(raw)
    return int(raw)


def nice_value(raw: str) -> int:
    """A Linux nice value, -20 (first for the CPU) to 19 (last), from text; raises ``ValueError``."""
    text = raw.strip()
    digits = text[1:] if text[:1] in "+-" else text
    if not digits.isdigit() or not -20 <= int(text) <= 19:
        raise ValueError(raw)
    return int(text)


def setting(default: Any, doc: str, **constraints: Any) -> Any:
    """A settings field: its default, a sentence on what it trades off, and its constraints
    (pydantic's ``ge``, ``gt``, ``le``, ``pattern``, ``min_length``...)."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("settings defaults must be immutable")
    return Field(default=default, description=doc, **constraints)


class Section(BaseModel):
    """A frozen group of settings; an unknown field is an error, not a silent no-op."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)
