"""One training step through tile_fmha_with_backward on a new shape, timed.

The first step includes compiling and autotuning every kernel for the shape (skipped on
later runs: the choice is cached on disk); the later steps show the steady state.

    python examples/train_step.py --batch 4 --heads 16 --seqlen 4096 --head-dim 128
"""

import argparse
import sys
import time

import torch

from tilegym import requirements, tile_fmha_with_backward
from tilegym.ops.attention.reference import attention_reference


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's example lines; shows each option's default."""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("--batch", type=int, default=4, help="batch size")
    parser.add_argument("--heads", type=int, default=16, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads, fewer than --heads for GQA")
    parser.add_argument("--seqlen", type=int, default=4096, help="sequence length of queries and keys")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim: 32, 64, 80, 96, 128 or 256")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16", help="input dtype")
    parser.add_argument("--full", action="store_true", help="non-causal attention (default: causal)")
    parser.add_argument("--steps", type=int, default=3, help="training steps to time")
    args = parser.parse_args()
    try:
        requirements.check(0)
    except requirements.RequirementError as missing:
        sys.exit(f"train_step: {missing}")

    dtype = getattr(torch, args.dtype)
    kv_heads = args.kv_heads or args.heads
    causal = not args.full

    def fresh(heads):
        shape = (args.batch, heads, args.seqlen, args.head_dim)
        return torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)

    q, k, v = fresh(args.heads), fresh(kv_heads), fresh(kv_heads)
    d_out = torch.randn_like(q)
    for step in range(args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = tile_fmha_with_backward(q, k, v, is_causal=causal)
        loss = (out * d_out).sum()  # a scalar loss, as in training: backward() takes no gradient
        loss.backward()
        torch.cuda.synchronize()
        label = "first step (compile + autotune)" if step == 0 else f"step {step}"
        print(f"{label}: {time.perf_counter() - start:.3f} s")
        q.grad = k.grad = v.grad = None

    # A quick sanity check of the result on the first batch element and head group.
    small = [t.detach()[:1, : max(1, args.heads // kv_heads)].double() for t in (q, k[:, :1], v[:, :1])]
    expected, _ = attention_reference(*small, is_causal=causal)
    error = (out.detach()[:1, : small[0].shape[1]].double() - expected).abs().max().item()
    print(f"max |out - fp64 reference| on one head group: {error:.2e}")


if __name__ == "__main__":
    main()
