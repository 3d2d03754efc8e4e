"""Seconds of the first training step on a new shape, in new processes: with empty caches
(compile and autotune) and again with the caches the first process filled.

Runs examples/train_step.py twice with its own tune and compile cache directories, so the
caches of the calling process and of the user are left alone. The training benchmark
(bench_attention_backward.py) runs this first and keeps the times in its JSON file; alone:

    python tests/benchmark/first_call.py
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

TRAIN_STEP = Path(__file__).resolve().parents[2] / "examples" / "train_step.py"
SHAPE = {"batch": 4, "heads": 16, "seqlen": 4096, "head_dim": 128, "causal": True, "dtype": "bfloat16"}
_FIRST_STEP = re.compile(r"^first step[^:]*: ([0-9.]+) s$", re.MULTILINE)


def _first_step_seconds(environment: dict) -> float:
    command = [
        sys.executable, str(TRAIN_STEP), "--batch", str(SHAPE["batch"]), "--heads", str(SHAPE["heads"]),
        "--seqlen", str(SHAPE["seqlen"]), "--head-dim", str(SHAPE["head_dim"]), "--dtype", SHAPE["dtype"],
    ]  # fmt: skip
    if not SHAPE["causal"]:
        command.append("--full")
    run = subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
    found = _FIRST_STEP.search(run.stdout)
    if found is None:
        raise RuntimeError(f"no first-step time in the output of {TRAIN_STEP.name}:\n{run.stdout}{run.stderr}")
    return float(found.group(1))


def measure() -> dict:
    """{"shape": ..., "cold_s": ..., "warm_s": ...}: the cold run compiles and tunes every kernel."""
    with tempfile.TemporaryDirectory(prefix="tilegym-first-call-") as scratch:
        environment = dict(os.environ, TILEGYM_AUTOTUNE_QUIET="1")
        environment.pop("DISABLE_AUTOTUNE", None)
        environment["TILEGYM_CACHE_DIR"] = os.path.join(scratch, "tilegym")
        environment["CUDA_TILE_CACHE_DIR"] = os.path.join(scratch, "cutile")
        cold = _first_step_seconds(environment)
        warm = _first_step_seconds(environment)
    return {"shape": dict(SHAPE), "cold_s": cold, "warm_s": warm}


def summary(first_call: dict) -> str:
    shape = first_call["shape"]
    mask = "causal" if shape["causal"] else "full"
    return (
        f"First training step on a new shape (B={shape['batch']}, H={shape['heads']}, S={shape['seqlen']}, "
        f"D={shape['head_dim']}, {shape['dtype']}, {mask}), new process: {first_call['cold_s']:.1f} s with "
        f"empty caches (compile + autotune), {first_call['warm_s']:.2f} s with warm caches"
    )


def main() -> None:
    # bench_utils imports this module, so this module imports it only when run as a script.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.benchmark.bench_utils import HelpFormatter

    argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter).parse_args()
    print(summary(measure()))


if __name__ == "__main__":
    main()
