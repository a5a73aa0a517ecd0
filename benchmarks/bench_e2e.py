"""End-to-end offline throughput: SITS beside HF transformers generate, same weights, same GPU, same run.

    python benchmarks/bench_e2e.py --config llama-3-8b --batch 32 --input-len 2048 --output-len 512
    python benchmarks/bench_e2e.py --config llama-3-8b --quantization fp8
    python benchmarks/bench_e2e.py --config llama-3-8b --batch 1 --input-len 2048 --output-len 128

The same command as `sits bench` (sits.runtime.commands.bench): the table it prints last holds
time, output and total tok/s, TTFT and ITL percentiles, the ratio against transformers and the
fraction of the roofline BASELINES.md defines.
"""

import sys

from sits.runtime.commands.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
