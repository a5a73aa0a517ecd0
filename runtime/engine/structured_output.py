"""Structured outputs enforced with xgrammar: OpenAI's `response_format` (json_object, json_schema)
and vLLM's `structured_outputs` / `guided_*` (json, regex, choice, grammar, json_object).

xgrammar (the grammar engine vLLM uses) compiles a JSON schema, a regex or an EBNF grammar against
the model's vocabulary once; a `GrammarMatcher` per sequence then says, before each sampling step,
which tokens keep the text a prefix of a valid output (a bitmask over the logits, `grammar_mask.py`),
and is advanced with the token that was sampled. Once the output is complete and cannot go on the
grammar allows only the stop tokens, so the completion ends with finish_reason "stop"; reaching
max_tokens first ends it with "length" and the output cut short, as in vLLM and OpenAI. A choice
is compiled as a grammar whose root is the alternation of the choices as string literals (every
character escaped as needed, so quotes, backslashes and regex metacharacters stand for themselves).

Costs, and where they are paid:
  - `GrammarCache` builds xgrammar's view of the tokenizer on the first structured request only,
    and compiles each distinct constraint once (an LRU keyed by the spec's kind and text). The
    server checks a request's grammar first in a killable worker process with a timeout, then
    compiles it on its own grammar threads, before the request reaches the engine
    (`sits.runtime.server.grammar_compiler`: a schema, regex or grammar xgrammar refuses, or one
    too deep, too large or too slow to compile, is a 400 naming the field it came from), so the
    engine finds it cached.
  - `StructuredOutputs` gives each constrained sequence its own matcher (`Sequence.grammar`;
    n > 1: one per completion); a step without constrained sequences does no work for them at all.
    The stop check (`stopping.py`) advances a matcher with each token and ends the sequence when
    its grammar ended.
  - A matcher needs the previous token before it can build the next mask, so the engine does not
    run ahead (async scheduling) while a constrained request runs, as for penalties.

A matcher counts the tokens it accepted, and `catch_up` feeds it only the sequence's output tokens
past that count: a sequence that was preempted and recomputes its context (its output tokens go
through the model again) never advances its matcher twice.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from sits.runtime.engine.request import SamplingParamsError, StructuredOutputSpec
from sits.runtime.engine.sequence import Sequence as EngineSequence

logger = logging.getLogger(__name__)

RESPONSE_FORMAT = "response_format"  # the OpenAI parameter errors name
# Compact JSON (no optional whitespace between tokens): a small model left free to emit whitespace
# may emit nothing else until max_tokens; the documents stay valid JSON either way.
ANY_WHITESPACE = False
# Matchers buffer this many accepted tokens for rollback; none is needed (no speculative decoding).
_MAX_ROLLBACK_TOKENS = 0


class StructuredOutputError(SamplingParamsError):
    """An output constraint the grammar engine cannot enforce (a 400 naming `param`, by default
    response_format)."""

    def __init__(self, message: str, param: str = RESPONSE_FORMAT) -> None:
        super().__init__(param, message)


def json_schema_spec(schema: Any, source: str = "response_format.json_schema.schema") -> StructuredOutputSpec:
    """The spec of a JSON schema (from the request field `source`): the schema must be a JSON object."""
    param = source.split(".", 1)[0]
    if not isinstance(schema, dict):
        raise StructuredOutputError(f"{source} must be a JSON object, got {type(schema).__name__}", param)
    try:
        # Keys keep their order: it is the order the document's properties are generated in.
        text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as error:
        raise StructuredOutputError(f"{source} is not valid JSON: {error}", param) from None
    return StructuredOutputSpec("json_schema", text, source)


def regex_spec(pattern: str, source: str) -> StructuredOutputSpec:
    """The output must match `pattern` whole (xgrammar's regex dialect, close to JavaScript's)."""
    return StructuredOutputSpec("regex", pattern, source)


def grammar_spec(grammar: str, source: str) -> StructuredOutputSpec:
    """The output must derive from the grammar's `root` rule (EBNF as xgrammar's compile_grammar reads it)."""
    return StructuredOutputSpec("grammar", grammar, source)


def choice_spec(choices: Sequence[str], source: str) -> StructuredOutputSpec:
    """The output must be exactly one of `choices` (a non-empty list of strings)."""
    if not choices or not all(isinstance(choice, str) for choice in choices):
        raise StructuredOutputError(f"{source} must be a non-empty list of strings", source.split(".", 1)[0])
    alternatives = " | ".join(ebnf_literal(choice) for choice in dict.fromkeys(choices))
    return StructuredOutputSpec("choice", f"root ::= {alternatives}", source)


def ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal that matches exactly it: quote and backslash escaped, and
    every character outside printable ASCII written as a \\u / \\U escape (newlines included)."""
    parts = ['"']
    for char in text:
        if char in '"\\':
            parts.append("\\" + char)
        elif " " <= char <= "~":
            parts.append(char)
        elif ord(char) <= 0xFFFF:
            parts.append(f"\\u{ord(char):04x}")
        else:
            parts.append(f"\\U{ord(char):08x}")
    parts.append('"')
    return "".join(parts)


JSON_OBJECT = StructuredOutputSpec("json_object")
_ANY_OBJECT_SCHEMA = '{"type":"object"}'


class GrammarCache:
    """Compiled grammars of the specs seen lately, for one tokenizer (thread-safe).

    Args:
        tokenizer: the engine's tokenizer (`token_to_bytes(i)`, `vocab_size`, `eos_token_ids`,
            `all_special_ids`).
        vocab_size: the width of the model's logits (may exceed the tokenizer's vocabulary; the
            ids past it are never allowed).
        capacity: compiled grammars kept (least recently used dropped first).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, capacity: int = 64) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.capacity = capacity
        self._lock = threading.Lock()  # guards the LRU and the lazily built compiler
        self._compiled: OrderedDict[StructuredOutputSpec, Any] = OrderedDict()
        self._compiler: Any = None
        self._info: Any = None  # the xgrammar.TokenizerInfo the compiler was built on

    def contains(self, spec: StructuredOutputSpec) -> bool:
        """Whether `spec` is compiled already (then `compile` returns at once)."""
        with self._lock:
            return spec in self._compiled

    def tokenizer_info_json(self) -> str:
        """xgrammar's view of the vocabulary, serialized (`TokenizerInfo.serialize_json`): what a
        compile worker in another process needs to compile exactly as this cache does."""
        with self._lock:
            self._compiler = self._compiler or self._new_compiler()
            info = self._info
        return info.serialize_json()

    def compile(self, spec: StructuredOutputSpec) -> Any:
        """The `xgrammar.CompiledGrammar` of `spec`, compiled on the first call for it.

        Raises:
            StructuredOutputError: the schema is not one xgrammar can enforce.
        """
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled
            compiler = self._compiler = self._compiler or self._new_compiler()
        compiled = compile_spec(compiler, spec)  # outside the lock: another thread may hit the cache meanwhile
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled

    def _new_compiler(self) -> Any:
        """xgrammar's compiler over our tokenizer's raw token bytes (no HF tokenizer is needed).

        Special tokens get empty byte strings, which xgrammar treats as special: never allowed
        inside a document; the stop tokens (EOS) only once it is complete.
        """
        import xgrammar  # imported on the first structured request: serving without it costs nothing

        tokenizer = self.tokenizer
        special = frozenset(getattr(tokenizer, "all_special_ids", ()))
        vocab = [b"" if i in special else tokenizer.token_to_bytes(i) for i in range(tokenizer.vocab_size)]
        stop_ids = sorted(i for i in tokenizer.eos_token_ids if i < self.vocab_size)
        info = self._info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=self.vocab_size,
                                                   stop_token_ids=stop_ids)
        return grammar_compiler_for(info)


def grammar_compiler_for(tokenizer_info: Any) -> Any:
    """An `xgrammar.GrammarCompiler` over `tokenizer_info`, one thread, without xgrammar's own cache
    (`GrammarCache`'s LRU bounds what is kept; xgrammar's cache would grow without limit)."""
    import xgrammar

    return xgrammar.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)


def compile_spec(compiler: Any, spec: StructuredOutputSpec) -> Any:
    """`spec` compiled by an `xgrammar.GrammarCompiler` (raises StructuredOutputError naming its param)."""
    if spec.kind != "json_object" and spec.text is None:
        raise StructuredOutputError(f"{spec.source} is missing", spec.param)
    try:
        if spec.kind == "regex":
            return compiler.compile_regex(spec.text)
        if spec.kind in ("grammar", "choice"):
            return compiler.compile_grammar(spec.text, root_rule_name="root")
        # json_object: any object (strict_mode=False keeps its undeclared properties allowed).
        schema = _ANY_OBJECT_SCHEMA if spec.kind == "json_object" else spec.text
        return compiler.compile_json_schema(schema, any_whitespace=ANY_WHITESPACE,
                                            strict_mode=spec.kind == "json_schema")
    except Exception as error:  # whatever the grammar engine refuses in a client's constraint is a 400
        raise StructuredOutputError(f"{spec.source} cannot be enforced: {_reason(error)}", spec.param) from None


def _reason(error: Exception) -> str:
    """xgrammar's message without its log prefix ("[12:00:00] /project/cpp/x.cc:94: ...")."""
    reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    return reason.split(": ", 1)[-1] if reason.startswith("[") else reason


class SequenceGrammar:
    """One sequence's matcher, how many of its output tokens it accepted, and the width of the
    logits its bitmask covers (`vocab_size`)."""

    __slots__ = ("matcher", "num_accepted", "ended", "vocab_size")

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled, max_rollback_tokens=_MAX_ROLLBACK_TOKENS)
        self.vocab_size = vocab_size
        self.num_accepted = 0
        self.ended = False  # the matcher terminated or refused a token: it allows nothing more

    def catch_up(self, output_token_ids: Sequence[int]) -> bool:
        """Accept the output tokens it has not seen yet; True once the grammar ended (complete and
        a stop token accepted, or a token it refused, e.g. one the min_tokens mask forced)."""
        while not self.ended and self.num_accepted < len(output_token_ids):
            token_id = output_token_ids[self.num_accepted]
            self.num_accepted += 1
            if not self.matcher.accept_token(token_id):
                logger.warning("structured output: token %d is not allowed here; the sequence ends", token_id)
                self.ended = True
            elif self.matcher.is_terminated():
                self.ended = True
        return self.ended

    def fill(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` ([N, ceil(V / 32)] int32)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)


class StructuredOutputs:
    """The engine's structured-output state: the grammar cache, and the matchers it gave to
    constrained sequences (each on its sequence, `Sequence.grammar`; a preempted sequence keeps
    its matcher). It counts the matchers live, so `bool()` says whether any constrained sequence
    runs."""

    def __init__(self, tokenizer: Any, vocab_size: int, capacity: int = 64) -> None:
        self.cache = GrammarCache(tokenizer, vocab_size, capacity)
        self.vocab_size = vocab_size
        self._num_live = 0

    def __bool__(self) -> bool:
        """Whether any constrained sequence is live."""
        return self._num_live > 0

    def __len__(self) -> int:
        return self._num_live

    def add(self, sequences: Iterable[EngineSequence], spec: StructuredOutputSpec) -> None:
        """Give each sequence its own matcher (raises StructuredOutputError for a bad spec)."""
        compiled = self.cache.compile(spec)
        for seq in sequences:
            seq.grammar = SequenceGrammar(compiled, self.vocab_size)
            self._num_live += 1

    def release(self, sequences: Iterable[EngineSequence]) -> None:
        """Drop the matchers of sequences whose request finished (a sequence without one is skipped)."""
        for seq in sequences:
            if seq.grammar is not None:
                seq.grammar = None
                self._num_live -= 1
