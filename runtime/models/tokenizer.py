"""Text ↔ token ids and chat prompts, on the fast `tokenizers` library (no transformers at runtime).

A `Tokenizer` is built from an HF `tokenizer.json` plus the special tokens and chat template of
`tokenizer_config.json` (or `chat_template.jinja`); GGUF files are first converted to that form
(`sits.runtime.models.gguf_tokenizer`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from sits.runtime.models.chat_template import ChatTemplateError, render_chat_template

__all__ = ["ChatTemplateError", "Tokenizer", "bytes_to_unicode"]

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte 0..255 spelled as one printable character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


class Tokenizer:
    """A model's tokenizer and chat template.

    Args:
        backend: the `tokenizers.Tokenizer` (vocabulary, normalizer, pre-tokenizer, decoder).
        special_tokens: bos_token / eos_token / unk_token / pad_token strings (None when absent).
        chat_template: the jinja2 template, or None.
        extra_eos_token_ids: ids that end generation besides eos_token (e.g. Llama 3's <|eot_id|>).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: dict[str, str | None] | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        self.special_tokens = {name: (special_tokens or {}).get(name) for name in SPECIAL_TOKEN_NAMES}
        self.chat_template = chat_template
        self.bos_token_id = self._id_of(self.special_tokens["bos_token"])
        self.eos_token_id = self._id_of(self.special_tokens["eos_token"])
        eos = set(extra_eos_token_ids)
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        added = backend.get_added_tokens_decoder()
        self.all_special_ids: frozenset[int] = frozenset(i for i, tok in added.items() if tok.special)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._byte_level = _uses_byte_level(json.loads(backend.to_str()))
        self._added_ids = frozenset(added)

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def from_file(
        cls,
        tokenizer_json: str | Path,
        tokenizer_config: str | Path | dict[str, Any] | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> Tokenizer:
        """Load `tokenizer.json`; special tokens and template from a tokenizer_config (path or dict).

        An explicit `chat_template` wins over the one in tokenizer_config.
        """
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_json))
        config = tokenizer_config
        if isinstance(config, (str, Path)):
            config = json.loads(Path(config).read_text(encoding="utf-8"))
        config = config or {}
        special = {name: _token_content(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        template = chat_template if chat_template is not None else _template_from_config(config.get("chat_template"))
        return cls(backend, special, template, extra_eos_token_ids)

    @classmethod
    def from_directory(cls, directory: str | Path, extra_eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Load an HF tokenizer directory: tokenizer.json, tokenizer_config.json, chat_template.jinja/.json."""
        directory = Path(directory)
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        map_path = directory / "special_tokens_map.json"
        if map_path.exists():
            for name, value in json.loads(map_path.read_text(encoding="utf-8")).items():
                config.setdefault(name, value)
        template = None
        if (directory / "chat_template.jinja").exists():
            template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
        elif (directory / "chat_template.json").exists():
            template = _template_from_config(
                json.loads((directory / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
            )
        return cls.from_file(directory / "tokenizer.json", config, template, extra_eos_token_ids)

    def with_chat_template(self, chat_template: str | None) -> Tokenizer:
        """The same tokenizer with another chat template (e.g. a `--chat-template` override)."""
        return Tokenizer(self._backend, self.special_tokens, chat_template, self.eos_token_ids)

    # -- text ↔ ids ------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; add_special_tokens adds what the model's post-processor adds (e.g. BOS).

        Special-token text in `text` (such as "<|im_end|>") becomes the special token, as in
        transformers; encode chat prompts from `apply_chat_template` with add_special_tokens=False.
        """
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ids; an incomplete UTF-8 sequence at the end decodes to U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (OpenAI logprobs' `bytes`); b"" for unknown ids."""
        if not 0 <= token_id < 2**32:
            return b""
        return _token_bytes(self._backend, self._byte_level, token_id in self._added_ids, token_id)

    def token_to_text(self, token_id: int) -> str:
        """One token's text (OpenAI logprobs' `token`); bytes that are not valid UTF-8 show as U+FFFD."""
        return self.token_to_bytes(token_id).decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry as spelled in tokenizer.json (e.g. 'Ġthe')."""
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    # -- chat ------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text for a conversation (same output as transformers' apply_chat_template).

        kwargs: continue_final_message, tools, documents, and any variable the template reads.
        Raises:
            ChatTemplateError: no template, or the template rejected the conversation.
        """
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens, **kwargs,
        )

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _template_from_config(value: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of named templates (take "default")."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) else None


def _uses_byte_level(spec: dict[str, Any]) -> bool:
    """Whether the decoder maps GPT-2's byte alphabet back to bytes (else sentencepiece-style)."""
    decoder = spec.get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(part.get("type") == "ByteLevel" for part in parts if part)


@functools.lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    return {char: byte for byte, char in bytes_to_unicode().items()}


def _token_bytes(backend: tokenizers.Tokenizer, byte_level: bool, is_added: bool, token_id: int) -> bytes:
    piece = backend.id_to_token(token_id)
    if piece is None:
        return b""
    if is_added:
        return piece.encode("utf-8")
    if byte_level:
        byte_of = _byte_of_char()
        if all(char in byte_of for char in piece):
            return bytes(byte_of[char] for char in piece)
        return piece.encode("utf-8")
    # sentencepiece: "<0x0A>" is a raw byte, "▁" a space
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")
