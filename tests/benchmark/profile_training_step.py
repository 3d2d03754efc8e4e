r"""One training step (forward, then backward) of ours and of SDPA's cuDNN backend inside a CUDA
profiler range, for Nsight Compute. Kept to reproduce perf-notes#q-loaded-twice:

    ncu --clock-control none --profile-from-start off --set full -o step -f \
        python tests/benchmark/profile_training_step.py --seqlen 4096 --head-dim 128
    ncu -i step.ncu-rep --page source --csv --print-source sass > step_source.csv

Inputs and providers are the training benchmark's (bench_utils: 16384 tokens, hidden 2048,
bf16). Both steps run three times first, so compiling and tuning stay outside the range (set
DISABLE_AUTOTUNE=1 to profile the default configs).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmark import bench_utils  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=bench_utils.HelpFormatter)
    p.add_argument("--seqlen", type=int, default=4096, help="sequence length; batch = 16384 // seqlen")
    p.add_argument("--head-dim", type=int, default=128, help="head dim D; H = 2048 / D")
    p.add_argument("--causal", action="store_true", help="causal masking")
    args = p.parse_args()
    import torch  # after parsing, so that --help needs no GPU stack

    (shape,) = bench_utils.shapes([args.head_dim], [args.causal], ["bfloat16"], [args.seqlen])
    inputs = bench_utils.make_inputs(shape, requires_grad=True)
    d_out = torch.randn_like(inputs[0])
    steps = [bench_utils.attention_fn(provider, shape, training=True) for provider in ("cutile", "cudnn")]

    def run_steps():
        for fn in steps:
            torch.autograd.grad(fn(*inputs), inputs, d_out)

    for _ in range(3):
        run_steps()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run_steps()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
