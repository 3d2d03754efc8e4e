"""Score modifiers for training (bias with dBias, key-padding bias, sliding window, softcap,
ALiBi, all together): forward, backward and forward + backward, each against our plain
attention measured in the same run.

    python tests/benchmark/bench_attention_variants.py --out docs/benchmarks/h100
    python tests/benchmark/bench_attention_variants.py --replot docs/benchmarks/h100/attention_variants.json
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmark import bench_utils  # noqa: E402
from tests.benchmark.bench_utils import OPTIONS, Shape  # noqa: E402

PREFIX = "attention_variants"


def variant_shapes(head_dims, causal_options, seqlens, options) -> list[Shape]:
    """16384 tokens, hidden 2048, bf16: plain attention and each option."""
    result = []
    for head_dim in head_dims:
        heads = bench_utils.HIDDEN // head_dim
        for causal in causal_options:
            for seqlen in seqlens:
                batch = max(1, bench_utils.TOKENS // seqlen)
                for option in ("", *options):
                    result.append(Shape(batch, heads, heads, seqlen, seqlen, head_dim, causal, "bfloat16", option))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--modes", nargs="+", choices=bench_utils.MODE_FLOP_FACTOR, default=list(bench_utils.MODE_FLOP_FACTOR)
    )
    p.add_argument("--head-dims", nargs="+", type=int, default=[128])
    p.add_argument("--causal", choices=("both", "true", "false"), default="true")
    p.add_argument("--seqlens", nargs="+", type=int, default=[1024, 4096, 16384])
    p.add_argument("--options", nargs="+", choices=OPTIONS, default=list(OPTIONS))
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    p.add_argument("--replot", type=Path, help="only plot and summarize an earlier JSON file")
    args = p.parse_args()
    if args.replot:
        results, _ = bench_utils.load_json(args.replot)
    else:
        shape_list = variant_shapes(args.head_dims, bench_utils.causal_options(args.causal), args.seqlens, args.options)
        started = time.perf_counter()
        results = bench_utils.run_all(args.modes, ["cutile"], shape_list)
        meta = bench_utils._environment()
        meta.update({"command": " ".join(bench_utils._argv()), "wall_seconds": round(time.perf_counter() - started, 1)})
        bench_utils.save_json(results, args.out / f"{PREFIX}.json", meta)
    plots = bench_utils.plot(results, args.out, PREFIX)
    print(bench_utils.table(results))
    print()
    print(bench_utils.option_cost_summary(results))
    print(f"\n{len(plots)} plots in {args.out}")


if __name__ == "__main__":
    main()
