"""`sits bench` figures: one system's timings, the roofline, and the side-by-side table.

The roofline follows BASELINES.md: prefill at the device's dense matrix rate, then each decode step
reads every weight byte and the live KV cache of every sequence at HBM bandwidth. Its time for the
benchmark's batch is the floor no engine can beat; `fraction of roofline` is that floor over the
measured time.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field

from sits.runtime.models.config import LlamaConfig


@dataclass
class RunResult:
    """One system's run of the benchmark batch.

    Attributes:
        system: a label ("SITS bf16 triton", "transformers 5.17 generate").
        seconds: wall time from submitting the batch to its last token.
        output_tokens, prompt_tokens: totals over the batch.
        ttft_s: per-request time to first token, seconds.
        itl_s: gaps between consecutive tokens of a request, seconds.
        itl_is_mean: the ITL figures are a mean per step (no per-token timestamps were taken).
        measured: False when the figure was given on the command line instead of measured now.
        notes: anything worth printing beside the figure.
        short: the name a peer's column goes by ("transformers", "static cache"); empty: the label's first word.
        cpu_s: CPU seconds this process spent (all its threads, user + system) from submitting the batch to its
            last token; None where not measured. Compared with `seconds` it tells a busy machine from a slow engine.
    """

    system: str
    seconds: float
    output_tokens: int
    prompt_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    itl_is_mean: bool = False
    measured: bool = True
    notes: str = ""
    short: str = ""
    cpu_s: float | None = None

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def total_tok_s(self) -> float:
        return (self.output_tokens + self.prompt_tokens) / self.seconds if self.seconds > 0 else float("nan")


def percentile(values: list[float], q: int) -> float:
    """The q-th percentile (q in 1..99), linear between order statistics; nan when empty."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


@dataclass(frozen=True)
class Roofline:
    """The floor of one benchmark batch on one device, in seconds, and its parts."""

    prefill_s: float
    decode_s: float

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s


def roofline(config: LlamaConfig, weight_bytes: int, batch: int, input_len: int, output_len: int,
             matmul_flops: float, hbm_bytes_per_s: float, kv_dtype_bytes: int = 2) -> Roofline:
    """BASELINES.md's roofline for `batch` prompts of input_len tokens, each generating output_len.

    Args:
        config: the model shape (matmul parameters, attention geometry, KV size per token).
        weight_bytes: every parameter byte the model holds (what one decode step reads).
        matmul_flops: the dense matrix rate prefill runs at (bf16, or fp8 with fp8 weights), FLOP/s.
        hbm_bytes_per_s: memory bandwidth, bytes/s.
    """
    c = config
    q_width, kv_width = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = c.hidden_size * (q_width + 2 * kv_width) + q_width * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    matmul_params = c.num_hidden_layers * per_layer + c.hidden_size * c.vocab_size
    prompt_tokens = batch * input_len
    attention_flops = batch * c.num_hidden_layers * 2 * input_len * input_len * q_width  # causal QK^T + PV
    prefill_s = (2 * matmul_params * prompt_tokens + attention_flops) / matmul_flops
    kv_per_token = c.kv_bytes_per_token(kv_dtype_bytes)
    # Step i (0-based) reads every weight and each sequence's input_len + i cached tokens.
    live_kv_tokens = batch * (output_len * input_len + output_len * (output_len - 1) / 2)
    decode_s = (output_len * weight_bytes + live_kv_tokens * kv_per_token) / hbm_bytes_per_s
    return Roofline(prefill_s, decode_s)


def _peer_name(peer: RunResult) -> str:
    """A peer's column header name: its `short` name, else its label's first word."""
    return peer.short or peer.system.split()[0]


def _ratios(r: RunResult, peer: RunResult) -> str:
    """r against a peer: output tok/s ratio and, where both measured ITL, the peer's ITL p50 over r's (> 1: r is
    faster per token)."""
    if r is peer:
        return "1.00x"
    cell = f"{r.output_tok_s / peer.output_tok_s:.2f}x"
    if r.itl_s and peer.itl_s:
        cell += f", ITL {percentile(peer.itl_s, 50) / percentile(r.itl_s, 50):.2f}x"
    return cell


def format_table(results: list[RunResult], peers: list[RunResult], floor: Roofline | None) -> str:
    """The side-by-side table: one row per system; per peer a column of output tok/s ratios against it (and ITL
    p50 ratios, the peer's over the row's); the fraction of the roofline."""
    header = "| system | time s | output tok/s | total tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms "
    header += "".join(f"| vs {_peer_name(p)} " for p in peers) + ("" if peers else "| vs transformers ") + "| of roofline |"
    columns = 7 + max(len(peers), 1)
    lines = [header, "|" + "---|" * columns]
    for r in peers + results:
        ratios = " | ".join(_ratios(r, p) for p in peers) if peers else "—"
        fraction = f"{floor.seconds / r.seconds:.0%}" if floor and r.seconds > 0 else "—"
        ttft = f"{1e3 * percentile(r.ttft_s, 50):.1f} / {1e3 * percentile(r.ttft_s, 99):.1f}" if r.ttft_s else "—"
        mark = " (mean)" if r.itl_is_mean else ""
        itl = f"{1e3 * percentile(r.itl_s, 50):.2f} / {1e3 * percentile(r.itl_s, 99):.2f}{mark}" if r.itl_s else "—"
        label = r.system + ("" if r.measured else " (figure from an earlier run)")
        lines.append(f"| {label} | {r.seconds:.2f} | {r.output_tok_s:,.0f} | {r.total_tok_s:,.0f} | {ttft} | {itl} "
                     f"| {ratios} | {fraction} |")
    if floor:
        out = results[0].output_tokens if results else 0
        lines.append(f"| roofline (prefill {floor.prefill_s:.2f} s + decode {floor.decode_s:.2f} s) | "
                     f"{floor.seconds:.2f} | {out / floor.seconds:,.0f} | — | — | — |" + " — |" * max(len(peers), 1)
                     + " 100% |")
    return "\n".join(lines)


def to_json(results: list[RunResult], peers: list[RunResult], floor: Roofline | None, setup: dict) -> str:
    """Everything measured, for the record (figures in seconds and tokens per second). "peer" is the first peer
    (transformers where it ran) with each result's "ratio_vs_peer"; "peers" holds every peer, and each result's
    "ratios" its output tok/s ratio and ITL ratio (the peer's ITL p50 over the result's) per peer label."""
    first = peers[0] if peers else None

    def entry(r: RunResult) -> dict:
        data = asdict(r)
        data.update(output_tok_s=r.output_tok_s, total_tok_s=r.total_tok_s,
                    ttft_p50_s=percentile(r.ttft_s, 50), ttft_p99_s=percentile(r.ttft_s, 99),
                    itl_p50_s=percentile(r.itl_s, 50), itl_p99_s=percentile(r.itl_s, 99))
        data.pop("ttft_s")
        data.pop("itl_s")
        if first and r is not first:
            data["ratio_vs_peer"] = r.output_tok_s / first.output_tok_s
        if all(r is not p for p in peers):
            data["ratios"] = {p.system: {"output_tok_s": r.output_tok_s / p.output_tok_s,
                                         "itl": percentile(p.itl_s, 50) / percentile(r.itl_s, 50)
                                         if p.itl_s and r.itl_s else None} for p in peers}
        if floor:
            data["fraction_of_roofline"] = floor.seconds / r.seconds
        return data

    return json.dumps({"setup": setup, "peer": entry(first) if first else None, "peers": [entry(p) for p in peers],
                       "results": [entry(r) for r in results],
                       "roofline": asdict(floor) | {"seconds": floor.seconds} if floor else None}, indent=2)
