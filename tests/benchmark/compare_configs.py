r"""Time one kernel's candidate configs against each other, beside SDPA cuDNN, in interleaved rounds.

Each config of the kernel's table runs as if it were the table's only one (tuning off), so
the same call times the same shapes under every config; rounds alternate the configs so that
a drift of the GPU's clock spoils each config alike. For a same-run A/B of a table change:

    python tests/benchmark/compare_configs.py attention_forward_lse_fixed_max --head-dim 64 \
        --modes fwd --seqlens 4096 8192 16384 --rounds 2

Configs: those of the table (the variant's name as in variants.py, sm_90, 16-bit inputs), or
--configs block_m,block_n[,num_worker_warps[,occupancy[,num_ctas]]] ... in their place.
Prints TFLOPS per (mode, shape) and config, each round's and the better of them, with cuDNN's.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmark import bench_utils  # noqa: E402

# tilegym is imported where it is used, so that --help needs no GPU stack.

_CONFIG_FIELDS = ("block_m", "block_n", "num_worker_warps", "occupancy", "num_ctas")


def parse_config(text: str):
    """A TileConfig from 'block_m,block_n[,num_worker_warps[,occupancy[,num_ctas]]]'."""
    from tilegym.autotune import TileConfig

    values = [int(part) for part in text.split(",")]
    if not 1 <= len(values) <= len(_CONFIG_FIELDS):
        raise argparse.ArgumentTypeError(f"{text!r}: give 1 to {len(_CONFIG_FIELDS)} integers")
    return TileConfig(**dict(zip(_CONFIG_FIELDS, values, strict=False)))


def label(config) -> str:
    return ",".join(str(getattr(config, name)) for name in _CONFIG_FIELDS if getattr(config, name) is not None)


def only(kernel: str, config):
    """A context under which `kernel` has `config` as its only candidate (autotune.force_config)."""
    from tilegym import autotune

    return autotune.force_config(kernel, config)


def run(kernel: str, config_list, modes, shape_list, rounds: int) -> dict:
    """{(mode, shape): {label: [TFLOPS per round], "cudnn": [...]}}"""

    results: dict = {}
    for round_index in range(rounds):
        for config in config_list:
            with only(kernel, config):
                for shape in shape_list:
                    for mode in modes:
                        result = bench_utils.measure(mode, "cutile", shape)
                        results.setdefault((mode, shape), {}).setdefault(label(config), []).append(result.tflops)
                        print(f"round {round_index} {label(config):>14s} {mode:8s} {shape.series} "
                              f"S={shape.seqlen_q}: {result.tflops or 0:.0f} {result.note}", flush=True)  # fmt: skip
        for shape in shape_list:
            for mode in modes:
                result = bench_utils.measure(mode, "cudnn", shape)
                results.setdefault((mode, shape), {}).setdefault("cudnn", []).append(result.tflops)
    return results


def summary(results: dict) -> str:
    lines = []
    for (mode, shape), by_config in results.items():
        cells = []
        for name, values in by_config.items():
            rounds = "/".join(f"{value:.0f}" if value else "n/a" for value in values)
            best = max((value for value in values if value), default=None)
            cells.append(f"{name} {rounds}" + (f" (best {best:.0f})" if best else ""))
        lines.append(f"{mode:8s} {shape.series:20s} S={shape.seqlen_q:<6d} " + " | ".join(cells))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=bench_utils.HelpFormatter)
    p.add_argument("kernel", help="a variant of variants.py, e.g. attention_forward_lse_fixed_max")
    p.add_argument("--head-dim", type=int, required=True, help="head dim D; H = 2048 / D")
    p.add_argument("--configs", nargs="+", type=parse_config, metavar="CONFIG",
                   help="configs to compare (default: the kernel's sm_90 table)")  # fmt: skip
    p.add_argument("--modes", nargs="+", choices=tuple(bench_utils.MODE_FLOP_FACTOR), default=["fwd"],
                   help="what to time")  # fmt: skip
    p.add_argument("--causal", choices=("both", "true", "false"), default="both", help="causal, full or both")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16", help="input dtype")
    p.add_argument("--seqlens", nargs="+", type=int, default=[1024, 4096, 16384],
                   help="sequence lengths; batch = 16384 // seqlen")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2, help="rounds over every config")
    args = p.parse_args()
    from tilegym.ops.attention import configs
    from tilegym.ops.attention.variants import VARIANTS

    if args.kernel not in VARIANTS:
        p.error(f"unknown variant {args.kernel!r}; the registry has {', '.join(VARIANTS)}")
    os.environ["DISABLE_AUTOTUNE"] = "1"
    config_list = args.configs or configs.candidates(args.kernel, "sm_90", args.head_dim, 2)
    if not config_list:
        p.error(f"{args.kernel} has no sm_90 table at head dim {args.head_dim}: give --configs")
    shape_list = bench_utils.shapes(
        [args.head_dim], bench_utils.causal_options(args.causal), [args.dtype], args.seqlens
    )
    print(summary(run(args.kernel, config_list, args.modes, shape_list, args.rounds)))


if __name__ == "__main__":
    main()
