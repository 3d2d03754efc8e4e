"""CPU tests of the benchmark scripts' command lines: --help of every script, and --replot."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.benchmark import bench_utils
from tests.benchmark.bench_utils import Result, Shape

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = [
    "bench_attention.py",
    "bench_attention_backward.py",
    "bench_attention_variants.py",
    "bench_context_parallel.py",
    "bench_huggingface.py",
    "bench_programmable.py",
    "bench_training_graphs.py",
    "bench_value_dim.py",
    "bench_varlen.py",
    "compare_configs.py",
    "first_call.py",
    "host_time.py",
    "profile_training_step.py",
    "replot.py",
]
COMMITTED = ROOT / "docs" / "benchmarks" / "h100"
# What --help and --replot must not import: they run where there is no GPU stack, and an
# import of these is the first step of a benchmark.
GPU_STACK = ("torch", "tilegym", "cuda", "triton")


def _run(script: str, *args: str, blocked=GPU_STACK) -> tuple[subprocess.CompletedProcess, float]:
    """The script run as `python tests/benchmark/<script> args`, with `blocked` unimportable
    (None in sys.modules makes `import name` raise ImportError); and its seconds."""
    path = str(Path("tests/benchmark") / script)
    code = (
        "import runpy, sys\n"
        f"for name in {tuple(blocked)!r}:\n"
        "    sys.modules[name] = None\n"
        f"sys.argv = [{path!r}, *{list(args)!r}]\n"
        f"runpy.run_path({path!r}, run_name='__main__')\n"
    )
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return run, time.perf_counter() - started


@pytest.mark.parametrize("script", SCRIPTS)
def test_cli_help_prints_and_starts_nothing(script):
    run, seconds = _run(script, "--help", blocked=(*GPU_STACK, "matplotlib"))
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"usage: {script}") and seconds < 20
    # The description's example commands stay one per line, as in the docstring.
    docstring = (ROOT / "tests" / "benchmark" / script).read_text().split('"""')[1]
    examples = [line for line in docstring.splitlines() if line.strip().startswith(("python ", "ncu ", "torchrun "))]
    assert examples and all(line in run.stdout.splitlines() for line in examples)
    # Every option has help, and options with a default show it (those without say what happens).
    options = run.stdout.split("\noptions:\n", 1)[1]
    entries = re.split(r"\n(?=  -)", options.strip("\n"))
    for entry in entries:
        first, *rest = entry.strip().splitlines()
        assert rest or re.search(r"\S {2,}\S", first), entry
    if len(entries) > 1:
        assert "(default: " in options


@pytest.mark.parametrize("path", ["stubbed", "unprepared"])
def test_cli_host_time_stubbed_runs_without_a_gpu(path):
    # The stubbed launch path must keep working as launch.py changes: it is how trees are compared.
    flags = ("--stubbed", "--unprepared") if path == "unprepared" else ("--stubbed",)
    run, _ = _run("host_time.py", *flags, "--calls", "2", "--rounds", "1", blocked=())
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 4 and all(f"launch.forward + launch.backward, {path}:" in line for line in lines)


def test_cli_examples_do_not_write_into_the_shipped_results():
    # replot.py is how the shipped figures are redrawn; the JSON files are never its output.
    for script in SCRIPTS:
        if script != "replot.py":
            assert "--out docs/" not in (ROOT / "tests" / "benchmark" / script).read_text(), script


def test_cli_committed_results_name_their_benchmark():
    for path in sorted(COMMITTED.glob("*.json")):
        _, meta = bench_utils.load_json(path)
        assert bench_utils.benchmark_of(meta) == path.stem
        assert {"gpu", "torch", "cuda_tile"} <= meta.keys()


def _write(path: Path, benchmark: str, seqlens=(1024,)) -> Path:
    results = []
    for seqlen in seqlens:
        shape = Shape(16384 // seqlen, 16, 16, seqlen, seqlen, 128, True, "bfloat16")
        for provider, tflops in (("cutile", 400.0), ("cudnn", 500.0)):
            results.append(Result("fwd", provider, shape, ms=1.0, tflops=tflops, gbps=100.0))
    bench_utils.save_json(results, path, {"benchmark": benchmark, "gpu": "synthetic"})
    return path


def test_cli_replot_refuses_a_file_of_another_benchmark(tmp_path):
    ours = _write(tmp_path / "attention_inference.json", "attention_inference")
    other = _write(tmp_path / "attention_training.json", "attention_training")
    run, _ = _run("bench_attention.py", "--replot", str(ours), str(other), "--out", str(tmp_path / "plots"))
    assert run.returncode == 2
    assert f"{other} holds attention_training results" in run.stderr and "bench_attention_backward.py" in run.stderr
    assert not (tmp_path / "plots").exists()
    # Files written before meta named their benchmark name it through their command.
    with pytest.raises(ValueError, match="attention_variants.json holds attention_variants results"):
        bench_utils.load_results([COMMITTED / "attention_variants.json"], "attention_training")


def test_cli_replot_merges_several_files_without_a_gpu_stack(tmp_path):
    first = _write(tmp_path / "a.json", "attention_inference", seqlens=(1024, 4096))
    second = _write(tmp_path / "b.json", "attention_inference", seqlens=(4096, 16384))
    run, _ = _run("bench_attention.py", "--replot", str(first), str(second), "--out", str(tmp_path / "plots"))
    assert run.returncode == 0, run.stderr
    names = sorted(path.name for path in (tmp_path / "plots").iterdir())
    assert names == ["attention_inference-fwd-d128-causal-bfloat16-GBps.png",
                     "attention_inference-fwd-d128-causal-bfloat16-TFLOPS.png",
                     "attention_inference-overview-ours_vs_cuDNN.png"]  # fmt: skip
    assert "  16384 " in run.stdout and run.stdout.count("  4096 ") == 1  # one row per cell


def test_cli_replot_all_writes_an_index_of_every_figure(tmp_path):
    files = [
        _write(tmp_path / "attention_training.json", "attention_training"),
        _write(tmp_path / "attention_inference.json", "attention_inference"),
    ]
    out, index = tmp_path / "h100", tmp_path / "README.md"
    run, _ = _run("replot.py", *map(str, files), "--out", str(out), "--index", str(index))
    assert run.returncode == 0, run.stderr
    _assert_index_lists(index, out)


def _assert_index_lists(index: Path, out: Path):
    """Every figure of `out` once on its own line, the overviews first; the GPU is named."""
    text = index.read_text()
    linked = re.findall(r"^- \[[^]]+\]\(([^)]+\.png)\)", text, re.MULTILINE)
    figures = sorted(path.relative_to(index.parent).as_posix() for path in out.glob("*.png"))
    assert sorted(linked) == figures and len(set(linked)) == len(linked)
    overviews = [link for link in linked if "-overview-" in link]
    assert overviews and linked[: len(overviews)] == overviews
    assert "| data | command | GPU and versions |" in text


def test_cli_committed_index_lists_every_committed_figure():
    _assert_index_lists(ROOT / "docs" / "benchmarks" / "README.md", COMMITTED)


def test_cli_replot_of_the_goal_run_prints_the_goal_table(tmp_path):
    """The README's table of the backward's goal comes from replotting the committed --goal run:
    every cell of the goal, one row each, against cuDNN and FlashAttention-4's figures."""
    goal = COMMITTED / "goal" / "attention_training.json"
    _, meta = bench_utils.load_json(goal)
    assert "--goal" in meta["command"]
    run, _ = _run("bench_attention_backward.py", "--replot", str(goal), "--out", str(tmp_path / "plots"))
    assert run.returncode == 0, run.stderr
    # The goal table's rows name the series ("d128-causal-bfloat16"); the summary's before it do not.
    rows = [line for line in run.stdout.splitlines() if line.startswith("| d") and "-bfloat16" in line.split("|")[1]]
    assert len(rows) == len(bench_utils.GOAL_HEAD_DIMS) * 2 * len(bench_utils.GOAL_SEQLENS) + 2
    readme = (ROOT / "README.md").read_text()
    assert all(row in readme for row in rows), "the README's goal table is not this file's"
