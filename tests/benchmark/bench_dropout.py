"""Attention dropout's cost: a training step (forward, then the inputs' gradients) with
dropout_p 0 and 0.1, ours against SDPA's FlashAttention-2 and cuDNN backends in the same process.

    python tests/benchmark/bench_dropout.py

bf16, 16384 tokens, hidden 2048, S=4096; milliseconds, triton.testing.do_bench's mean.
"""

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from tilegym import tile_fmha_with_backward

SHAPES = ((128, True), (128, False), (64, True), (64, False))
SEQLEN = 4096


def _timed(step) -> float | str:
    try:
        step()
        step()
        return triton.testing.do_bench(step, warmup=50, rep=300)
    except Exception as error:  # an SDPA backend that does not run this case
        return f"n/a ({type(error).__name__})"


def _row(head_dim: int, causal: bool) -> str:
    batch, heads = 16384 // SEQLEN, 2048 // head_dim
    shape = (batch, heads, SEQLEN, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    d_out = torch.randn_like(q)

    def ours(rate):
        out = tile_fmha_with_backward(q, k, v, is_causal=causal, dropout_p=rate)
        torch.autograd.grad(out, (q, k, v), d_out)

    def sdpa(rate, backend):
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=rate)
        torch.autograd.grad(out, (q, k, v), d_out)

    providers = {"ours": ours, "fa2": lambda r: sdpa(r, SDPBackend.FLASH_ATTENTION),
                 "cudnn": lambda r: sdpa(r, SDPBackend.CUDNN_ATTENTION)}  # fmt: skip
    cells = []
    for name, step in providers.items():
        for rate in (0.0, 0.1):
            time = _timed(lambda step=step, rate=rate: step(rate))
            cells.append(f"{name} p={rate} {time:.3f}" if isinstance(time, float) else f"{name} p={rate} {time}")
    return f"D={head_dim} S={SEQLEN} causal={causal}: " + ", ".join(cells)


def main() -> None:
    for head_dim, causal in SHAPES:
        print(_row(head_dim, causal), flush=True)


if __name__ == "__main__":
    main()
