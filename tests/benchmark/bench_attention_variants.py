"""Score modifiers for training (bias with dBias, key-padding bias, sliding window, softcap,
ALiBi, all together): forward, backward and forward + backward, each against our plain
attention measured in the same run.

    python tests/benchmark/bench_attention_variants.py --seqlens 4096 --options softcap
    python tests/benchmark/bench_attention_variants.py --head-dims 64 --gqa 8 --options sinks window128 window128-sinks
    python tests/benchmark/bench_attention_variants.py --out bench-out/mine
    python tests/benchmark/bench_attention_variants.py --replot docs/benchmarks/h100/attention_variants.json

The shipped results in docs/benchmarks/h100 came from one run with the default options on an
H100 (the JSON file's meta holds its command, GPU and versions). Write new runs elsewhere, as
the default --out does, and compare them with those.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmark import bench_utils  # noqa: E402
from tests.benchmark.bench_utils import OPTIONS, Shape  # noqa: E402

PREFIX = "attention_variants"


def variant_shapes(head_dims, causal_options, seqlens, options, gqa: int = 1) -> list[Shape]:
    """16384 tokens, hidden 2048, bf16: plain attention and each option; gqa query heads per
    key/value head."""
    result = []
    for head_dim in head_dims:
        heads = bench_utils.HIDDEN // head_dim
        for causal in causal_options:
            for seqlen in seqlens:
                batch = max(1, bench_utils.TOKENS // seqlen)
                for option in ("", *options):
                    shape = Shape(batch, heads, heads // gqa, seqlen, seqlen, head_dim, causal, "bfloat16", option)
                    result.append(shape)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=bench_utils.HelpFormatter)
    modes = list(bench_utils.MODE_FLOP_FACTOR)
    p.add_argument("--modes", nargs="+", choices=modes, default=modes, help="what to time")
    p.add_argument("--head-dims", nargs="+", type=int, default=[128], help="head dims D; H = 2048 / D")
    p.add_argument("--causal", choices=("both", "true", "false"), default="true", help="causal, full or both")
    p.add_argument("--seqlens", nargs="+", type=int, default=[1024, 4096, 16384],
                   help="sequence lengths; batch = 16384 // seqlen")  # fmt: skip
    p.add_argument("--options", nargs="+", choices=OPTIONS, default=list(OPTIONS[:6]),
                   help="score modifiers, each timed beside plain attention")  # fmt: skip
    p.add_argument("--gqa", type=int, default=1, help="query heads per key/value head")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="directory for the JSON file and the figures")
    p.add_argument("--replot", nargs="+", type=Path, metavar="JSON",
                   help=f"measure nothing: redraw the figures and print the tables of earlier {PREFIX}.json "
                   "files (several are merged)")  # fmt: skip
    args = p.parse_args()
    if args.replot:
        results, metas = bench_utils.replot_results(p, args.replot, PREFIX)
    else:
        causal = bench_utils.causal_options(args.causal)
        shape_list = variant_shapes(args.head_dims, causal, args.seqlens, args.options, args.gqa)
        started = time.perf_counter()
        results = bench_utils.run_all(args.modes, ["cutile"], shape_list)
        meta = {"benchmark": PREFIX, **bench_utils._environment()}
        meta.update({"command": " ".join(bench_utils._argv()), "wall_seconds": round(time.perf_counter() - started, 1)})
        bench_utils.save_json(results, args.out / f"{PREFIX}.json", meta)
        metas = [meta]
    drawn = bench_utils.figures(PREFIX, results, args.out, metas)
    print(bench_utils.table(results))
    print()
    print(bench_utils.option_cost_summary(results))
    print(f"\n{len(drawn)} figures in {args.out}")


if __name__ == "__main__":
    main()
