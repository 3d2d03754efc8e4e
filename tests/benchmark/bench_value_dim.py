"""Attention with V's head dim different from Q's and K's (DeepSeek MLA trains with 192 and 128),
training, bf16, causal: ours at (Dqk, Dv), ours with q and k zero-padded to 256 by the caller,
and PyTorch SDPA on cuDNN where it takes the shape; fwd, bwd and fwd+bwd in ms and TFLOPS.

    python tests/benchmark/bench_value_dim.py
    python tests/benchmark/bench_value_dim.py --seqlens 4096 --pairs 192,128 128,64

FLOPs per visible query-key pair: forward 2 (Dqk + Dv) (QK^T, PV); backward 2 (3 Dqk + 2 Dv)
(QK^T again, dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q). 16384 tokens, 16 query heads.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmark import bench_utils  # noqa: E402

HEADS = 16
PROVIDERS = ("ours", "ours-padded-256", "cudnn")


def _flops(mode: str, pairs: int, batch: int, head_dim: int, value_dim: int) -> float:
    forward = 2.0 * (head_dim + value_dim)
    backward = 2.0 * (3 * head_dim + 2 * value_dim)
    per_pair = {"fwd": forward, "bwd": backward, "fwd+bwd": forward + backward}[mode]
    return per_pair * pairs * batch * HEADS


def _function(provider: str):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tilegym import tile_fmha_with_backward

    if provider == "ours":
        return lambda q, k, v: tile_fmha_with_backward(q, k, v, is_causal=True)
    if provider == "ours-padded-256":

        def padded(q, k, v):
            pad = 256 - q.shape[-1]
            scale = q.shape[-1] ** -0.5
            q, k = (torch.nn.functional.pad(t, (0, pad)) for t in (q, k))
            return tile_fmha_with_backward(q, k, v, scaling=scale, is_causal=True)

        return padded

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return cudnn


def measure(provider: str, mode: str, seqlen: int, head_dim: int, value_dim: int) -> dict:
    import torch

    batch = max(1, bench_utils.TOKENS // seqlen)
    row = {"provider": provider, "mode": mode, "seqlen": seqlen, "head_dim": head_dim, "value_dim": value_dim}
    if provider == "ours-padded-256" and head_dim >= 256:
        return {**row, "note": "already 256"}
    q, k = (torch.randn(batch, HEADS, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(batch, HEADS, seqlen, value_dim, device="cuda", dtype=torch.bfloat16)
    for t in (q, k, v):
        t.requires_grad_()
    fn = _function(provider)
    try:
        out = fn(q, k, v)
        d_out = torch.randn_like(out)
        # Compiles and tunes the backward, which the training forward started compiling in the
        # background: a forward timed meanwhile shares the host with it.
        torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True)
        calls = {
            "fwd": lambda: fn(q, k, v),
            "bwd": lambda: torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True),
            "fwd+bwd": lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), d_out),
        }
        ms = bench_utils.median_ms(calls[mode])
    except RuntimeError as error:  # a backend that does not take the shape
        return {**row, "note": str(error).splitlines()[0][:120]}
    pairs = bench_utils.visible_pairs(seqlen, seqlen, True)
    return {**row, "ms": ms, "tflops": _flops(mode, pairs, batch, head_dim, value_dim) / (ms * 1e-3) / 1e12}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=bench_utils.HelpFormatter)
    p.add_argument("--pairs", nargs="+", default=["192,128", "128,128", "256,128", "192,192"], help="Dqk,Dv pairs")
    p.add_argument("--seqlens", nargs="+", type=int, default=[4096, 16384], help="batch = 16384 // seqlen")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS), help="what to time")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="directory for value_dim.json")
    args = p.parse_args()
    rows = []
    for pair in args.pairs:
        head_dim, value_dim = (int(x) for x in pair.split(","))
        for seqlen in args.seqlens:
            for mode in ("fwd", "bwd", "fwd+bwd"):
                for provider in args.providers:
                    rows.append(measure(provider, mode, seqlen, head_dim, value_dim))
                    print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(bench_utils._argv()), **bench_utils._environment()}
    (args.out / "value_dim.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    print("\n| Dqk, Dv | S | mode | " + " | ".join(f"{p} ms (TFLOPS)" for p in args.providers) + " |")
    print("| --- | --- | --- |" + " --- |" * len(args.providers))
    for pair in args.pairs:
        head_dim, value_dim = (int(x) for x in pair.split(","))
        for seqlen in args.seqlens:
            for mode in ("fwd", "bwd", "fwd+bwd"):
                cells = []
                for provider in args.providers:
                    row = next(
                        r
                        for r in rows
                        if (r["provider"], r["mode"], r["seqlen"], r["head_dim"], r["value_dim"])
                        == (provider, mode, seqlen, head_dim, value_dim)
                    )
                    cells.append(f"{row['ms']:.2f} ({row['tflops']:.0f})" if "ms" in row else row["note"][:40])
                print(f"| {head_dim}, {value_dim} | {seqlen} | {mode} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
