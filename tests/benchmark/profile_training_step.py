"""One training step (forward with LSE, then backward) of ours and of SDPA's cuDNN backend inside
a CUDA profiler range, for Nsight Compute. Kept to reproduce docs/perf-notes.md section 26:

    ncu --clock-control none --profile-from-start off --set full -o step -f \
        python tests/benchmark/profile_training_step.py --seqlen 4096 --head-dim 128
    ncu -i step.ncu-rep --page source --csv --print-source sass > step_source.csv

Both steps run three times first, so compiling and tuning stay outside the range (set
DISABLE_AUTOTUNE=1 to profile the default configs). Shapes follow the benchmarks: 16384
tokens, hidden 2048, bf16.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from tilegym.ops.attention import launch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    args = p.parse_args()
    s, d = args.seqlen, args.head_dim
    b, h = max(16384 // s, 1), 2048 // d
    torch.manual_seed(0)
    q, k, v, d_out = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    problem, _ = launch.check_inputs(q, k, v, None, args.causal)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def ours():
        out, lse = launch.forward(q, k, v, problem, with_lse=True)
        launch.backward(d_out, q, k, v, out, lse, problem)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=args.causal)
            torch.autograd.grad(out, leaves, d_out)

    for _ in range(3):
        ours()
        cudnn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    ours()
    cudnn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
