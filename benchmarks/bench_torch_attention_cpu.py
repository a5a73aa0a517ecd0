"""The torch attention back end on a CPU: this version against the previous one, same run, same inputs.

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64, float32, 16-token blocks
handed out in scrambled order). A "step" is what the model asks of the back end in one engine
step: `rope_and_cache_write` then `forward`, once per layer, for `--layers` layers (30, as in
SmolLM2), with a fresh `AttentionMetadata` each step, so per-step set-up is paid as in serving.
The layers cycle over two K/V caches (a cache per layer would not fit a small machine at the long
contexts). The previous implementation is the module as of PREVIOUS_REVISION, read from git history
into a temporary module. Old and new steps alternate, so other work on the machine slows both
alike; the figure is the median step time, shown per layer, and the ratio old / new.

    PYTHONSAFEPATH=1 python benchmarks/bench_torch_attention_cpu.py [--layers 30] [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sits.runtime.attention.backend import AttentionMetadata
from sits.runtime.attention.registry import register_backend
from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.models.rotary import build_cos_sin_cache

# The last revision of runtime/attention/torch_ref.py before the SDPA rewrite.
PREVIOUS_REVISION = "6366078d5f94556d6ac83cac902d90dfe2c2f199"
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
MAX_POSITIONS = 4096


@dataclass
class Scenario:
    """One step's batch: prefills as (cached tokens, new tokens), then decodes by context length."""

    name: str
    prefills: list[tuple[int, int]]
    decode_contexts: list[int]


def scenarios(batch: int, seed: int) -> list[Scenario]:
    gen = torch.Generator().manual_seed(seed)

    def around(low: int, high: int) -> list[int]:
        return torch.randint(low, high + 1, (batch,), generator=gen).tolist()

    return [
        Scenario(f"decode {batch} x ~100", [], around(90, 110)),
        Scenario(f"decode {batch} x ~500", [], around(450, 550)),
        Scenario(f"decode {batch} x 2000", [], [2000] * batch),
        Scenario(f"decode {batch} x 100-2000", [], around(100, 2000)),
        Scenario(f"prefill {batch} prompts x ~40", [(0, n) for n in around(30, 50)], []),
        Scenario("prefill 1 x 512", [(0, 512)], []),
        Scenario("prefill 512 after 1500 cached", [(1500, 512)], []),
        Scenario(f"mixed: prefill 256 + decode {batch} x ~500", [(0, 256)], around(450, 550)),
    ]


def load_previous_backend() -> type:
    """TorchAttentionBackend as of PREVIOUS_REVISION, imported from git history into a temporary module."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(["git", "show", f"{PREVIOUS_REVISION}:runtime/attention/torch_ref.py"], cwd=root,
                            check=True, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "torch_ref_previous.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("torch_ref_previous", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    register_backend(TorchAttentionBackend)  # the old module registered itself under the same name
    return module.TorchAttentionBackend


class StepInputs:
    """Caches, block tables and per-layer q/k/v for one scenario, the same for both implementations."""

    def __init__(self, scenario: Scenario, layers: int, dtype: torch.dtype, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        chunks = [(cached, new) for cached, new in scenario.prefills] + [(c - 1, 1) for c in scenario.decode_contexts]
        blocks_per_seq = [-(-(cached + new) // BLOCK_SIZE) for cached, new in chunks]
        num_blocks = sum(blocks_per_seq) + 1
        order = torch.randperm(num_blocks, generator=gen).tolist()  # scrambled: real block-table indirection
        tables, positions, slots, taken = [], [], [], 0
        for (cached, new), count in zip(chunks, blocks_per_seq, strict=True):
            blocks = order[taken:taken + count]
            taken += count
            tables.append(blocks + [0] * (max(blocks_per_seq) - count))
            for position in range(cached, cached + new):
                positions.append(position)
                slots.append(blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
        self.tables = torch.tensor(tables, dtype=torch.int32)
        self.positions = torch.tensor(positions)
        self.slots = torch.tensor(slots)
        self.chunks = chunks
        self.num_prefills = len(scenario.prefills)
        shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.caches = [(torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
                       for _ in range(min(layers, 2))]
        tokens = len(positions)
        self.qkv = [(torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(dtype),
                     torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
                     torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)) for _ in range(layers)]
        self.cos_sin = build_cos_sin_cache(HEAD_DIM, MAX_POSITIONS, 10000.0)

    def metadata(self) -> AttentionMetadata:
        """A fresh metadata object, as the engine builds one per step."""
        query_lens = [new for _, new in self.chunks]
        seq_lens = [cached + new for cached, new in self.chunks]
        return AttentionMetadata(
            num_prefills=self.num_prefills, num_prefill_tokens=sum(query_lens[:self.num_prefills]),
            num_decodes=len(self.chunks) - self.num_prefills, slot_mapping=self.slots,
            query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=self.tables,
            max_query_len=max(query_lens), max_seq_len=max(seq_lens), seq_lens_list=seq_lens,
            query_lens_list=query_lens)

    def run_step(self, backend) -> torch.Tensor:
        """Every layer's cache write and attention; returns the last layer's output."""
        metadata = self.metadata()
        out = None
        for layer, (q, k, v) in enumerate(self.qkv):
            k_cache, v_cache = self.caches[layer % len(self.caches)]
            q_rot, k_rot = backend.rope_and_cache_write(q, k, v, self.positions, self.cos_sin, k_cache, v_cache,
                                                        self.slots)
            out = backend.forward(q_rot, k_rot, v, k_cache, v_cache, metadata, HEAD_DIM**-0.5)
        return out


def time_scenario(scenario: Scenario, previous, current, layers: int, repeats: int, dtype: torch.dtype
                  ) -> tuple[float, float, float]:
    """(previous ms per layer, current ms per layer, max |difference| of the outputs)."""
    inputs = StepInputs(scenario, layers, dtype, seed=1)
    difference = (inputs.run_step(previous).float() - inputs.run_step(current).float()).abs().max().item()
    times: dict[str, list[float]] = {"previous": [], "current": []}
    for _ in range(repeats):
        for name, backend in (("previous", previous), ("current", current)):
            started = time.perf_counter()
            inputs.run_step(backend)
            times[name].append((time.perf_counter() - started) * 1e3 / layers)
    return statistics.median(times["previous"]), statistics.median(times["current"]), difference


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30, help="layers per step (SmolLM2-135M has 30)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per implementation and scenario")
    parser.add_argument("--batch", type=int, default=16, help="sequences per decode step")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    previous, current = load_previous_backend()(), TorchAttentionBackend()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; {args.dtype}; "
          f"{HEADS} query / {KV_HEADS} KV heads, head_dim {HEAD_DIM}, block {BLOCK_SIZE}; {args.layers} layers a step")
    print("load average (1/5/15 min) at the start: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print("ms per layer (cache write + attention), median of alternating steps")
    print(f"{'scenario':42}{'previous':>10}{'current':>10}{'speed-up':>10}{'max |diff|':>12}")
    for scenario in scenarios(args.batch, seed=0):
        with torch.inference_mode():
            old_ms, new_ms, difference = time_scenario(scenario, previous, current, args.layers, args.repeats, dtype)
        print(f"{scenario.name:42}{old_ms:>10.3f}{new_ms:>10.3f}{old_ms / new_ms:>9.2f}x{difference:>12.2e}",
              flush=True)
    print("load average (1/5/15 min) at the end: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
