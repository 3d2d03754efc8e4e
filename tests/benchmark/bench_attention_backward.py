"""Attention for training: forward (with LSE), backward and forward + backward, in TFLOPS and
GBps, against PyTorch SDPA pinned to each backend; first, the seconds of the first training
step on a new shape in new processes, with empty and with warm caches (--no-first-call skips it).

    python tests/benchmark/bench_attention_backward.py --quick
    python tests/benchmark/bench_attention_backward.py --out bench-out/mine
    python tests/benchmark/bench_attention_backward.py --replot docs/benchmarks/h100/attention_training.json

The shipped results in docs/benchmarks/h100 came from one run with the default options on an
H100 (the JSON file's meta holds its command, GPU and versions). Write new runs elsewhere, as
the default --out does, and compare them with those.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmark import bench_utils  # noqa: E402

if __name__ == "__main__":
    bench_utils.main(__doc__, ("fwd", "bwd", "fwd+bwd"), "attention_training", training_forward=True, first_call=True)
