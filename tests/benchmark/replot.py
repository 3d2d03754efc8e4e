r"""Redraw the figures of benchmark result files, each file with its own benchmark's figures
(its meta says which benchmark wrote it), and write an index page that lists them.

    python tests/benchmark/replot.py bench-out/*.json

The figures in docs/benchmarks/h100 and the index docs/benchmarks/README.md were drawn from the
committed JSON files with:

    python tests/benchmark/replot.py docs/benchmarks/h100/*.json --out docs/benchmarks/h100 \
        --index docs/benchmarks/README.md
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmark import bench_utils  # noqa: E402

# The index's sections, in its order: what each benchmark measures and what its figures show.
SECTIONS = {
    "attention_training": (
        "Training: forward with LSE, backward, forward + backward",
        "TFLOPS and GBps against sequence length, a line per provider: ours and SDPA pinned to each backend.",
    ),
    "attention_inference": (
        "Inference: forward without LSE or autograd",
        "TFLOPS and GBps against sequence length, a line per provider: ours and SDPA pinned to each backend.",
    ),
    "attention_variants": (
        "Score modifiers",
        "Our TFLOPS with each modifier beside our plain attention of the same run, each point marked with "
        "its time relative to plain.",
    ),
}
OVERVIEWS = {
    "attention_training": "ours / cuDNN TFLOPS per mode, head dim, mask and sequence length; a panel per dtype and GQA",
    "attention_inference": "ours / cuDNN TFLOPS per head dim, mask and sequence length; a panel per dtype and GQA",
    "attention_variants": "time with each score modifier / time of plain attention, per mode and sequence length",
}


def _link(path: Path, index: Path) -> str:
    return Path(os.path.relpath(path, index.parent)).as_posix()


def index_page(sections, index: Path, command: str) -> str:
    """Markdown: where the data came from, the overviews, then every other figure by benchmark
    and mode, one line each. sections: [(benchmark, [(path, meta, measurements)], figures)]."""
    lines = [
        "# Benchmark figures",
        "",
        "Drawn from the JSON files below, and this page written, by",
        "",
        "```bash",
        command,
        "```",
        "",
        "Each JSON file holds one run of the command in its row, on the GPU named there (its `meta`",
        "records both); a run writes to `--out` (default `bench-out/`) and was copied here. Shapes:",
        f"batch x seqlen = {bench_utils.TOKENS} tokens, hidden {bench_utils.HIDDEN} (H = {bench_utils.HIDDEN} / D). "
        "TFLOPS count 4·B·Hq·D per",
        "visible query-key pair for the forward, 2.5x that for the backward and 3.5x for both; GBps",
        "divide the fewest bytes a mode must move by the time. One benchmark's figures alone:",
        "`python tests/benchmark/bench_attention_backward.py --replot docs/benchmarks/h100/attention_training.json`",
        "(writes to `bench-out/`).",
        "",
        "| data | command | GPU and versions | measurements | wall time |",
        "| --- | --- | --- | --- | --- |",
    ]
    for _, files, _ in sections:
        for path, meta, count in files:
            seconds = f"{meta['wall_seconds']:.0f} s" if "wall_seconds" in meta else "not recorded"
            lines.append(
                f"| [{path.name}]({_link(path, index)}) | `{meta.get('command', 'not recorded')}` | "
                f"{bench_utils.environment([meta])} | {count} | {seconds} |"
            )
    overviews = [(benchmark, f) for benchmark, _, figures in sections for f in figures if f.group == "overview"]
    lines += ["", "## Overview", ""]
    lines += [f"- [{f.title}]({_link(f.path, index)}): {OVERVIEWS[benchmark]}" for benchmark, f in overviews]
    for _, figure in overviews:
        lines += ["", f"![{figure.title}]({_link(figure.path, index)})"]
    for benchmark, files, figures in sections:
        heading, summary = SECTIONS[benchmark]
        names = ", ".join(f"`{path.name}`" for path, _, _ in files)
        lines += ["", f"## {heading}", "", f"{summary} From {names}."]
        group = None
        for figure in figures:
            if figure.group == "overview":
                continue
            if figure.group != group:
                group = figure.group
                lines += ["", f"### {group}", ""]
            lines.append(f"- [{figure.title}]({_link(figure.path, index)})")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=bench_utils.HelpFormatter)
    p.add_argument("files", nargs="+", type=Path, metavar="JSON", help="results files of any of the benchmarks")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="directory for the figures")
    p.add_argument("--index", type=Path, help="the index page to write (default: README.md in --out)")
    args = p.parse_args()
    by_benchmark: dict[str, list[tuple]] = {benchmark: [] for benchmark in SECTIONS}
    for path in args.files:
        try:
            results, meta = bench_utils.read_results(path)
        except ValueError as error:
            p.error(str(error))
        benchmark = bench_utils.benchmark_of(meta)
        if benchmark not in SECTIONS:
            p.error(f"{path}: written by no benchmark this script knows ({benchmark or 'its meta names none'})")
        by_benchmark[benchmark].append((path, meta, len(results)))
    sections = []
    for benchmark, files in by_benchmark.items():
        if files:
            results, metas = bench_utils.replot_results(p, [path for path, _, _ in files], benchmark)
            figures = bench_utils.figures(benchmark, results, args.out, metas)
            sections.append((benchmark, files, figures))
            print(f"{len(figures)} figures of {benchmark} in {args.out}")
    index = args.index or args.out / "README.md"
    index.parent.mkdir(parents=True, exist_ok=True)
    index.write_text(index_page(sections, index, " ".join(bench_utils._argv())))
    print(f"index: {index}")


if __name__ == "__main__":
    main()
