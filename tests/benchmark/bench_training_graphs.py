"""A training step (forward + backward) per call, called eagerly and replayed from a CUDA graph,
ours against PyTorch SDPA with the cuDNN backend, on short shapes where issuing a step costs
the host as much as the GPU's work or more. A CUDA graph (torch.cuda.graph, or
torch.compile(mode="reduce-overhead")) removes that host time for both.

    python tests/benchmark/bench_training_graphs.py

Prints microseconds per step; writes no files.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmark import bench_utils  # noqa: E402
from tests.benchmark.bench_utils import Shape  # noqa: E402

SHAPES = [
    Shape(2, 8, 8, 256, 256, 64, False, "bfloat16"),
    Shape(4, 16, 16, 512, 512, 64, True, "bfloat16"),
    Shape(8, 16, 16, 1024, 1024, 128, True, "bfloat16"),
    Shape(16, 16, 16, 1024, 1024, 128, True, "bfloat16"),  # the training benchmark's shortest
]
PROVIDERS = ("cutile", "cudnn")


def _training_step(provider: str, shape: Shape):
    import torch

    attention = bench_utils.attention_fn(provider, shape, training=True)
    q, k, v = bench_utils.make_inputs(shape, requires_grad=True)
    d_out = torch.randn_like(q)

    def step():
        torch.autograd.grad(attention(q, k, v), (q, k, v), d_out)

    return step


def _graphed(step):
    """step captured in a CUDA graph, after warm-up runs (compiles, tuning) on a side stream."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=bench_utils.HelpFormatter).parse_args()
    header = f"{'shape':<34}{'ours eager':>12}{'cuDNN eager':>13}{'ours graph':>12}{'cuDNN graph':>13}"
    print("training step, us per call (the faster of two do_bench medians); ratio = cuDNN's time / ours")
    print(header)
    for shape in SHAPES:
        times = {}
        for provider in PROVIDERS:
            step = _training_step(provider, shape)
            times[provider, "eager"] = bench_utils.median_ms(step) * 1e3
            times[provider, "graph"] = bench_utils.median_ms(_graphed(step)) * 1e3
        mask = "causal" if shape.causal else "full"
        name = f"B={shape.batch} H={shape.q_heads} S={shape.seqlen_q} D={shape.head_dim} {mask}"
        cells = []
        for mode in ("eager", "graph"):
            ours, cudnn = times["cutile", mode], times["cudnn", mode]
            cells += [f"{ours:.0f} ({cudnn / ours:.2f}x)", f"{cudnn:.0f}"]
        print(f"{name:<34}{cells[0]:>12}{cells[1]:>13}{cells[2]:>12}{cells[3]:>13}")


if __name__ == "__main__":
    main()
