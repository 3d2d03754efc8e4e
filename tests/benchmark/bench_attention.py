"""Attention for inference (forward, no LSE, no autograd) in TFLOPS and GBps, against PyTorch
SDPA pinned to each backend.

    python tests/benchmark/bench_attention.py --out docs/benchmarks/h100
    python tests/benchmark/bench_attention.py --quick
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmark import bench_utils  # noqa: E402

if __name__ == "__main__":
    bench_utils.main(__doc__, ("fwd",), "attention_inference", training_forward=False)
