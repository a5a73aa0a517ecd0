"""`Fields.parse_into`: a dataclass read from a camelCase mapping through its `spec_field` table."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from sits.operator.fields import Fields, SpecError, spec_field


@dataclass(frozen=True)
class _Sample:
    label: str  # not in the table: always given
    size: int = spec_field("sizeBytes", "integer", minimum=1)
    ratio: float = spec_field("ratio", "number", 0.5, minimum=0.0, maximum=1.0)
    every_s: float = spec_field("every", "duration", 60.0, minimum=1.0)
    on: bool = spec_field("on", "boolean", True)
    name: str | None = spec_field("name", "string", None, pattern=re.compile(r"^[a-z]+$"), what="lower-case letters")


def test_defaults_fill_the_fields_left_out_and_given_values_are_kept():
    parsed = Fields({"sizeBytes": 4}, "spec.sample").parse_into(_Sample, label="x")
    assert parsed == _Sample(label="x", size=4, ratio=0.5, every_s=60.0, on=True, name=None)


def test_every_kind_is_read_from_its_camel_case_key():
    data = {"sizeBytes": 8, "ratio": 0.25, "every": "2m", "on": False, "name": "abc"}
    assert Fields(data, "spec.sample").parse_into(_Sample, label="y") == _Sample("y", 8, 0.25, 120.0, False, "abc")


def test_a_field_without_default_is_required():
    with pytest.raises(SpecError) as caught:
        Fields({}, "spec.sample").parse_into(_Sample, label="x")
    assert caught.value.path == "spec.sample.sizeBytes"
    assert caught.value.message == "is required"


def test_the_first_invalid_field_in_declaration_order_is_named_with_its_check():
    data = {"sizeBytes": 0, "ratio": 2.0, "name": "ABC"}
    with pytest.raises(SpecError, match=r"^spec\.sample\.sizeBytes: must be an integer >= 1, got 0$"):
        Fields(data, "spec.sample").parse_into(_Sample, label="x")
    with pytest.raises(SpecError, match=r"^spec\.sample\.ratio: must be a number <= 1, got 2$"):
        Fields({**data, "sizeBytes": 1}, "spec.sample").parse_into(_Sample, label="x")
    with pytest.raises(SpecError, match=r"^spec\.sample\.name: must be lower-case letters, got 'ABC'$"):
        Fields({**data, "sizeBytes": 1, "ratio": 1.0}, "spec.sample").parse_into(_Sample, label="x")


def test_a_given_value_is_not_read_again():
    parsed = Fields({"sizeBytes": "not read"}, "spec.sample").parse_into(_Sample, label="x", size=3)
    assert parsed.size == 3
