"""Experiment: a fused one-pass backward (dK, dV and dQ from one kernel, dQ summed by fp32
atomics) against our two-kernel backward and SDPA's cuDNN backend. Plain attention only.

Kept to reproduce docs/perf-notes.md sections 10 and 18: adding block_m x D fp32 values to dQ
one element at a time per (query tile, key tile) pair lost (0.55-0.7x of the two-kernel
backward); a tile-wide sum through a tiled view (a TMA reduction, flag "t") reached parity
and more, and is what the library's fused backward (the dK/dV kernel with sum_dq) does.
Each row also times the library's two backwards, TILEGYM_BACKWARD=two-kernel and =fused
(whose dQ share is held for a step at D=128, section 19).

    python tests/benchmark/experiment_fused_backward.py 64,128,8 64,128,8t 64,128,8st 128,128,8t

Each argument is a config block_m,block_n[,num_worker_warps[,occupancy]] (block_n keys per
program, block_m query rows per step), followed by flags: "s" for a staggered query order,
"t" for dQ summed tile-wide (a tiled view's atomic_store_add, a TMA reduction on sm_90)
instead of one atomic per element.
"""

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmark import bench_utils  # noqa: E402

_SPEC = re.compile(r"\d+(,\d+){1,3},?[st]*")


def _spec(text: str) -> str:
    if not _SPEC.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r}: give block_m,block_n[,num_worker_warps[,occupancy]][s][t]")
    return text


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=bench_utils.HelpFormatter)
    p.add_argument("configs", nargs="*", type=_spec, default=["64,128,8"], metavar="CONFIG",
                   help="fused-backward configs to time, each with its flags")  # fmt: skip
    args = p.parse_args()
    from tests.benchmark.fused_backward_kernels import compare  # needs cuda.tile and a GPU

    for head_dim in (128, 64):
        for seqlen in (1024, 4096, 16384):
            for causal in (False, True):
                print(compare(head_dim, seqlen, causal, args.configs), flush=True)


if __name__ == "__main__":
    main()
