"""Compile sits.kernels.l2_prefetch's row kernel for the H200 (sm_90a), with and without evict_last.

    python benchmarks/compile_l2_prefetch_sm90.py [--json out.json]

The kernel as its launcher specializes it (byte pointers, 16-byte aligned), with EVICT_LAST off and on. Rows give
how many L2 evict-last cache policies the PTX creates (`createpolicy ... L2::evict_last`: none off, one per
prefetch on), registers and spills. Run it without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse

import triton
from sm90_compile import compile_sm90, report_rows

from sits.kernels import l2_prefetch

_KERNELS = {
    "rows": (l2_prefetch._l2_prefetch_rows_kernel,
             {"ptr": "*u8", "rows": "i32", "row_stride": "i32", "nbytes": "i32"}, {"ROWS": 256}, ("ptr", "row_stride")),
}


def compile_one(kernel: str, evict_last: bool) -> dict:
    fn, types, constexprs, aligned = _KERNELS[kernel]
    return compile_sm90(fn, types, dict(constexprs, EVICT_LAST=evict_last), aligned,
                        triton.Config({}, num_warps=2, num_stages=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    report_rows([(kernel, asked) for kernel in _KERNELS for asked in (False, True)],
                lambda kernel, asked: {"kernel": kernel, "evict_last_asked": asked}, compile_one, args.json)


if __name__ == "__main__":
    main()
