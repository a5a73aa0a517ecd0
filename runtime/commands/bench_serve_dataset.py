"""The requests of `sits bench serve`: the `random` and `prefix-repetition` datasets, and tenants' keys.

- `random` (vLLM's): each prompt has an input length drawn uniformly from
  [input_len x (1 - r), input_len x (1 + r)] (r = `--random-range-ratio`, 0 = exact) and an
  output length drawn likewise from output_len; prompt tokens are uniform random ids.
- `prefix-repetition` (multi-tenant): `--num-tenants` tenants, each with its own API key and its
  own shared prefix of `--prefix-len` random tokens; request i belongs to tenant i mod N and to
  user (i div N) mod `--users-per-tenant` of it (sent as OpenAI's `user`); its prompt is the tenant's
  prefix followed by a random suffix drawn as `random` draws a prompt.

Prompts are token ids (`ids`: for a `--load-format dummy` server, or any server that takes token-id
prompts) or text (`text`: random words from a small list, about one token each for BPE tokenizers;
the server's usage gives the exact count).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

PROMPT_FORMATS = ("ids", "text")
DATASETS = ("random", "prefix-repetition")
_WORDS = tuple(["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his", "her", "an", "were", "are", "which", "this", "be", "or", "had", "not", "one", "but", "new", "first", "they", "have", "all", "two", "their", "time", "has", "been", "other", "its", "after", "who", "more", "over", "world", "year", "city", "states", "made", "most", "used", "also", "people", "state", "may", "work", "where", "between", "some", "any", "these", "during", "house", "part", "since", "under", "life", "water", "small", "country", "school", "long", "great", "found", "well", "high", "game", "left"])


@dataclass(frozen=True)
class Tenant:
    """A tenant as the benchmark uses it: its name and the API key its requests carry ("" for none)."""

    name: str
    api_key: str


@dataclass(frozen=True)
class BenchRequest:
    """One request to send.

    Attributes:
        prompt: token ids, or text.
        prompt_len: its length in tokens as built (ids) or intended (text).
        output_len: max_tokens (exact with ignore_eos on servers that honour it).
        tenant: whose key it carries (None: the run's --api-key, if any).
        user: OpenAI's `user` field ("" to leave it out).
    """

    prompt: list[int] | str
    prompt_len: int
    output_len: int
    tenant: Tenant | None = None
    user: str = ""


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    low, high = max(1, int(mean * (1.0 - ratio))), max(1, int(mean * (1.0 + ratio)))
    return rng.randint(low, high)


def _tokens(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(count)]


def render(tokens: list[int], prompt_format: str) -> list[int] | str:
    """ids stay a list; text spells each id as a word of the list (so equal ids give equal text)."""
    if prompt_format == "ids":
        return tokens
    return " ".join(_WORDS[t % len(_WORDS)] for t in tokens)


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    prompt_format: str, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        length = _length(rng, input_len, range_ratio)
        requests.append(BenchRequest(render(_tokens(rng, length, vocab_size), prompt_format), length,
                                     _length(rng, output_len, range_ratio)))
    return requests


def prefix_repetition_requests(num_prompts: int, tenants: list[Tenant], users_per_tenant: int, prefix_len: int,
                               input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                               prompt_format: str, seed: int) -> list[BenchRequest]:
    """Request i: tenant i mod N, its user (i div N) mod users_per_tenant, prompt = tenant prefix + own suffix."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, prefix_len, vocab_size) for _ in tenants]
    requests = []
    for index in range(num_prompts):
        which = index % len(tenants)
        suffix = _tokens(rng, _length(rng, input_len, range_ratio), vocab_size)
        tokens = prefixes[which] + suffix
        user = f"{tenants[which].name}-user-{(index // len(tenants)) % users_per_tenant}"
        requests.append(BenchRequest(render(tokens, prompt_format), len(tokens), _length(rng, output_len, range_ratio),
                                     tenants[which], user))
    return requests


def generated_tenants(count: int) -> list[Tenant]:
    """N tenants with made-up keys (for a server started with the matching tenants file, or one without auth)."""
    return [Tenant(f"bench-tenant-{i}", f"sk-bench-tenant-{i}") for i in range(count)]


def tenants_from_file(path: str | Path) -> list[Tenant]:
    """The tenants of a `sits serve --tenants` YAML that carry a plain apiKey (the benchmark must send it).

    Raises:
        ValueError: the file cannot be read, or holds no tenant with an apiKey.
    """
    import yaml

    try:
        document = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"--tenants-file {path}: {error}") from None
    entries = document.get("tenants", []) if isinstance(document, dict) else []
    tenants = [Tenant(str(e["name"]), str(e["apiKey"])) for e in entries
               if isinstance(e, dict) and e.get("name") and e.get("apiKey")]
    if not tenants:
        raise ValueError(f"--tenants-file {path}: no tenant with a plain apiKey (the benchmark must send the keys)")
    return tenants


def tenants_yaml(tenants: list[Tenant]) -> str:
    """A `sits serve --tenants` file for these tenants (equal priority and KV share)."""
    share = round(0.9 / len(tenants), 4)
    lines = ["tenants:"]
    lines += [f"  - {{name: {t.name}, apiKey: {t.api_key}, priority: 1, kvCacheShare: {share}}}" for t in tenants]
    return "\n".join(lines) + "\n"
