"""Hypothesis strategies for the request messages of every gRPC method, built from the proto descriptors
in kiln/v1 (so a field added to runtime.proto is fuzzed without a change here).

Each scalar field draws from its whole wire range with the edges weighted in (0, -1, the type's
extremes; NaN and infinities for floating point), strings are arbitrary unicode (protobuf strings
cannot hold lone surrogates; odd code points, NULs and combining marks they can), repeated fields are
short, empty or huge, and an `optional` field is as often absent as present. Fields that name a
session or hold token ids also draw real ids (`known`), so a request gets past the first check into
the code behind it; the constraint fields draw from tests/fuzz/constraint_strategies.py too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

from tests.fuzz.constraint_strategies import grammars, json_schemas, regexes

CONSTRAINTS = {"json_schema": json_schemas(), "regex": regexes(), "grammar": grammars()}  # GenerateRequest's
HUGE_REPEATED = 100_000  # elements of a huge repeated field (under the 4 MiB request limit)
FieldType = FieldDescriptor

_INTEGER_RANGES = {
    FieldType.TYPE_INT32: (-(2**31), 2**31 - 1), FieldType.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldType.TYPE_SFIXED32: (-(2**31), 2**31 - 1), FieldType.TYPE_UINT32: (0, 2**32 - 1),
    FieldType.TYPE_FIXED32: (0, 2**32 - 1), FieldType.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldType.TYPE_SINT64: (-(2**63), 2**63 - 1), FieldType.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldType.TYPE_UINT64: (0, 2**64 - 1), FieldType.TYPE_FIXED64: (0, 2**64 - 1),
}


@dataclass(frozen=True)
class Known:
    """Real values worth drawing beside random ones: live session ids, the vocabulary's size."""

    session_ids: Sequence[str]
    vocab_size: int


def integers(low: int, high: int) -> st.SearchStrategy[int]:
    edges = sorted({value for value in (low, low + 1, -1, 0, 1, high - 1, high) if low <= value <= high})
    return st.one_of(st.sampled_from(edges), st.integers(low, high))


def floats(width: int) -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from([0.0, -0.0, 1.0, float("nan"), float("inf"), float("-inf"), 1e-45, 1e308]),
                     st.floats(width=width))


def texts() -> st.SearchStrategy[str]:
    odd = st.sampled_from(["", "\x00", "\u200b\u0301" * 64, "\ufeff", "\U0010ffff", "💥" * 1000, "a" * 70_000])
    return st.one_of(odd, st.text(st.characters(codec="utf-8"), max_size=64))


def _scalar(field: FieldDescriptor, known: Known) -> st.SearchStrategy:
    kind = field.type
    if kind in _INTEGER_RANGES:
        values = integers(*_INTEGER_RANGES[kind])
        if field.name.endswith("token_ids") or field.name == "at":
            values = st.one_of(st.integers(0, known.vocab_size - 1), values)
        return values
    if kind in (FieldType.TYPE_DOUBLE, FieldType.TYPE_FLOAT):
        return floats(64 if kind == FieldType.TYPE_DOUBLE else 32)
    if kind == FieldType.TYPE_BOOL:
        return st.booleans()
    if kind == FieldType.TYPE_STRING:
        if field.name == "session_id" and known.session_ids:
            return st.one_of(st.sampled_from(list(known.session_ids)), texts())
        if field.name in CONSTRAINTS:
            return st.one_of(CONSTRAINTS[field.name], texts())
        return texts()
    if kind == FieldType.TYPE_BYTES:
        return st.binary(max_size=256)
    if kind == FieldType.TYPE_ENUM:
        return st.one_of(st.sampled_from([value.number for value in field.enum_type.values]), integers(-(2**31), 2**31 - 1))
    if kind == FieldType.TYPE_MESSAGE:
        return messages(field.message_type, known)
    raise AssertionError(f"no strategy for field type {kind} of {field.full_name}")


def _field(field: FieldDescriptor, known: Known) -> st.SearchStrategy:
    element = _scalar(field, known)
    if not _is_repeated(field):
        return element
    return st.one_of(st.lists(element, max_size=20), _huge(field, element))


def _huge(field: FieldDescriptor, element: st.SearchStrategy) -> st.SearchStrategy[list]:
    """HUGE_REPEATED copies of one short element (a few MB on the wire at most)."""
    if field.type == FieldType.TYPE_STRING:
        element = st.sampled_from(["", "x", "\x00"])
    elif field.type in (FieldType.TYPE_BYTES, FieldType.TYPE_MESSAGE):
        return st.just([])
    return element.map(lambda value: [value] * HUGE_REPEATED)


def _is_repeated(field: FieldDescriptor) -> bool:
    return field.is_repeated


def messages(descriptor: Descriptor, known: Known) -> st.SearchStrategy[Message]:
    """Messages of this type: every field independently present (with a drawn value) or absent."""
    fields = {field.name: st.one_of(st.none(), _field(field, known)) for field in descriptor.fields}
    message_class = GetMessageClass(descriptor)
    return st.fixed_dictionaries(fields).map(lambda values: _build(message_class, values))


def _build(message_class: type[Message], values: dict) -> Message:
    message = message_class()
    for name, value in values.items():
        if isinstance(value, Message):
            getattr(message, name).CopyFrom(value)
        elif isinstance(value, list):
            getattr(message, name).extend(value)
        elif value is not None:
            setattr(message, name, value)
    return message
