"""vLLM's structured-output request parameters: `structured_outputs` and the older flat `guided_*`.

Both endpoints take them (the openai client sends them through `extra_body`):

- `structured_outputs`: an object with exactly one of `json` (a JSON schema, as an object or a string
  holding one), `regex`, `choice` (a non-empty list of strings), `grammar` (EBNF as xgrammar reads
  it, with a `root` rule) or `json_object: true`. `disable_any_whitespace`,
  `disable_additional_properties` and `disable_fallback` are accepted: JSON is always generated
  compact, schemas are always enforced strictly, and there is one grammar back end to fall back from.
  `whitespace_pattern` and `structural_tag` are 400s (xgrammar, the back end, does not take them).
- `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`: the same constraints, flat (vLLM
  removed them in 0.12; clients written for earlier versions still send them).
  `guided_decoding_backend` may be "xgrammar" or "auto" (with vLLM's ":option" suffixes); any other
  back end, and `guided_whitespace_pattern`, are 400s.

A request takes one output constraint: response_format (other than text), structured_outputs or one
guided_* parameter (`check_one_constraint`). The constraint becomes an engine `StructuredOutputSpec`
in `sampling.py`; what the grammar engine refuses is a 400 naming the field the client sent.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, model_validator

from sits.runtime.server.errors import invalid_request
from sits.runtime.server.protocol_base import StrictModel

GUIDED_CONSTRAINTS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
BACKENDS = ("xgrammar", "auto")
BACKEND_OPTIONS = ("no-fallback", "disable-any-whitespace", "disable-additional-properties")
# structured_outputs' constraints, in the order the one given is looked for
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


def _schema_object(value: Any) -> Any:
    """A JSON schema as an object, or a string holding one (parsed here: a 400 if it is not JSON)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise ValueError(f"must be a JSON schema, as an object or a string of JSON: {error}") from None
        except RecursionError:  # the parser's stack, not ours: a 400, never a 500 with a traceback
            raise ValueError("nests too deeply to be a JSON schema (see the server's grammar nesting limit)") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"must be a JSON schema object, got {type(value).__name__}")
    return value


def _choices(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise ValueError("must be a non-empty list of strings")
    for index, choice in enumerate(value):
        if not isinstance(choice, str):
            raise ValueError(f"must be a list of strings; item {index} is {choice!r}")
    return value


def _backend(value: Any) -> Any:
    """vLLM's backend names ("xgrammar", "auto", optionally "name:option,option"): only xgrammar runs."""
    if value is None or not isinstance(value, str):
        return value
    name, _, options = value.partition(":")
    if name not in BACKENDS:
        raise ValueError(f"{value!r} is not available: this server enforces structured outputs with "
                         f"xgrammar (send {' or '.join(repr(b) for b in BACKENDS)}, or leave it out)")
    unknown = [option for option in options.split(",") if option and option not in BACKEND_OPTIONS]
    if unknown:
        raise ValueError(f"unknown backend option {unknown[0]!r}; known: {', '.join(BACKEND_OPTIONS)}")
    return value


def _unsupported(what: str) -> Any:
    def refuse(value: Any) -> Any:
        if value is not None:
            raise ValueError(f"is not supported: {what}")
        return value

    return refuse


_WHITESPACE = ("xgrammar generates JSON without optional whitespace (as with disable_any_whitespace), "
               "and takes no pattern for it")
SchemaObject = Annotated[dict[str, Any] | None, BeforeValidator(_schema_object)]
Choices = Annotated[list[str] | None, BeforeValidator(_choices)]
Backend = Annotated[str | None, BeforeValidator(_backend)]
WhitespacePattern = Annotated[str | None, BeforeValidator(_unsupported(_WHITESPACE))]


class StructuredOutputsParams(StrictModel):
    """vLLM's `structured_outputs` object: exactly one constraint on the output."""

    json_: SchemaObject = Field(default=None, alias="json")
    regex: str | None = None
    choice: Choices = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # compact JSON is what is generated anyway
    disable_additional_properties: bool = False  # schemas are enforced strictly: no undeclared properties
    disable_fallback: bool = False  # one back end: nothing to fall back to
    whitespace_pattern: WhitespacePattern = None
    structural_tag: Annotated[Any, BeforeValidator(_unsupported("structural tags are not available"))] = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsParams:
        given = [name for name in CONSTRAINT_FIELDS if self._value(name) not in (None, False)]
        if len(given) != 1:
            found = f"got {', '.join(given)}" if given else "got none"
            raise ValueError(f"needs exactly one of {', '.join(CONSTRAINT_FIELDS)} ({found})")
        return self

    def _value(self, name: str) -> Any:
        return self.json_ if name == "json" else getattr(self, name)

    def constraint(self) -> tuple[str, Any]:
        """The one constraint given: (its name in CONSTRAINT_FIELDS, its value)."""
        name = next(name for name in CONSTRAINT_FIELDS if self._value(name) not in (None, False))
        return name, self._value(name)


def output_constraints(request: Any) -> list[str]:
    """The params of a request (completion or chat) that constrain its output, in the order given."""
    names = []
    if request.response_format is not None and request.response_format.type != "text":
        names.append("response_format")
    if request.structured_outputs is not None:
        names.append("structured_outputs")
    return names + [name for name in GUIDED_CONSTRAINTS if getattr(request, name) is not None]


def check_one_constraint(request: Any) -> None:
    """A 400 naming the second output constraint of a request that sends more than one."""
    names = output_constraints(request)
    if len(names) > 1:
        raise invalid_request(f"{names[1]} cannot be combined with {names[0]}: a request takes one output "
                              "constraint (response_format, structured_outputs or one guided_* parameter)",
                              names[1])
