"""Rendering a model's jinja2 chat template, the way transformers' `apply_chat_template` does.

Same environment (sandboxed, `trim_blocks`, `lstrip_blocks`, loop controls), the same helpers
(`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text) and the same variables
(`messages`, `add_generation_prompt`, `tools`, `documents`, the special tokens), so a prompt built
here is the prompt the model was trained on.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: the template rejected it, or there is no template."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile once per template text (the server renders the same template for every request)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from exc


def render_chat_template(
    source: str | None,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    special_tokens: dict[str, str | None] | None = None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """The prompt text for a conversation.

    Args:
        source: the jinja2 template; None means the model has none.
        messages: [{"role": ..., "content": ...}, ...] as the OpenAI API sends them.
        add_generation_prompt: end with the header that opens the assistant's turn.
        continue_final_message: leave the last (assistant) message open, for the model to continue.
        special_tokens: bos_token, eos_token, ... as the template expects them.
        tools, documents, kwargs: passed to the template as variables.
    Raises:
        ChatTemplateError: no template, the template raised (raise_exception), or rendering failed.
    """
    if source is None:
        raise ChatTemplateError("this model has no chat template; send a plain prompt to /v1/completions instead")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError("messages must be a list of objects")
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError("add_generation_prompt and continue_final_message cannot both be set")
    variables = {**(special_tokens or {}), **kwargs}
    try:
        rendered = compile_template(source).render(
            messages=messages, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt, **variables,
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template rejected the conversation: {exc}") from exc
    except (TypeError, KeyError, IndexError, AttributeError, ValueError) as exc:
        raise ChatTemplateError(f"the conversation does not fit the chat template: {exc}") from exc
    if continue_final_message:
        rendered = _cut_after_final_message(rendered, messages)
    return rendered


def _cut_after_final_message(rendered: str, messages: list[dict[str, Any]]) -> str:
    """Drop whatever the template appended after the last message's text (its end-of-turn tokens)."""
    if not messages:
        raise ChatTemplateError("continue_final_message needs at least one message")
    final = messages[-1].get("content")
    if isinstance(final, list):  # content parts: continue the last text part
        texts = [part.get("text", "") for part in final if isinstance(part, dict) and part.get("type") == "text"]
        final = texts[-1] if texts else ""
    if not isinstance(final, str) or final.strip() not in rendered:
        raise ChatTemplateError("continue_final_message: the final message does not appear in the rendered prompt")
    location = rendered.rindex(final.strip())
    if rendered[location:location + len(final.lstrip())] == final.lstrip():
        return rendered[:location + len(final.lstrip())]
    return rendered[:location + len(final.strip())]
