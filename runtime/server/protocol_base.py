"""The base of every OpenAI request body the server accepts."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError


class StrictModel(BaseModel):
    """Strict types (a string is not a number: `"max_tokens": "5"` is a 400 naming the field, not a
    silent conversion); unknown fields ignored, as vLLM does, so clients written for other
    OpenAI-compatible servers keep working."""

    model_config = ConfigDict(strict=True, extra="ignore")


def collapsed(error: ValidationError) -> ValueError:
    """The first fault of a nested field, as one message (the 400 then names the field itself)."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ()))
    message = str(first.get("msg", "")).removeprefix("Value error, ")
    return ValueError(f"{where}: {message}" if where else message)
