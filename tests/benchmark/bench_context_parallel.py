"""Context parallelism: one long sequence's training attention (forward and backward) split over
the GPUs of one machine (tilegym.parallel.context_parallel_attention), against our single-GPU
call on the whole sequence and against PyTorch's own context parallelism (ring attention around
SDPA's cuDNN kernels, torch.distributed.tensor.experimental.context_parallel) on the same shares.

    torchrun --nproc-per-node 2 tests/benchmark/bench_context_parallel.py
    torchrun --nproc-per-node 4 tests/benchmark/bench_context_parallel.py --seqlens 65536 131072
    torchrun --nproc-per-node 4 tests/benchmark/bench_context_parallel.py --packed-max 32768

bf16, causal, batch 1, zigzag layout on both (PyTorch's load balancer holds the same chunks).
Every rank runs the same fixed number of steps (a timing loop that adapts per rank would desync
the collectives); a step's time is the slowest rank's median. TFLOPS per GPU count the causal
pairs (bench_utils.visible_pairs) as the other benchmarks do, fwd+bwd = 3.5 forward matmul pairs.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmark import bench_utils  # noqa: E402


def _step_ms(fn, steps: int, warmup: int = 2) -> float:
    """The slowest rank's median time of fn in ms, every rank starting each step together."""
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        dist.barrier()
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    median = torch.tensor(sorted(times)[len(times) // 2], device="cuda")
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median)


def _training_step(attention, leaves, d_out):
    def step():
        for t in leaves:
            t.grad = None
        attention(*leaves).backward(d_out)

    return step


def _measure(seqlen: int, args, rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from tilegym import tile_fmha_with_backward
    from tilegym.parallel import SequenceSharding, context_parallel_attention
    from tilegym.parallel.collectives import all_gather, reduce_scatter

    sharding = SequenceSharding("zigzag", world, seqlen)
    generator = torch.Generator(device="cuda").manual_seed(0)

    def draw(heads, dim=args.head_dim):
        shape = (1, heads, seqlen, dim)
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)

    whole = [draw(args.heads), draw(args.kv_heads), draw(args.kv_heads), draw(args.heads)]
    shares = [sharding.shard(t, rank, 2).contiguous() for t in whole]
    leaves = [t.clone().requires_grad_() for t in shares[:3]]
    d_out = shares[3]
    row = {"seqlen": seqlen, "world": world}
    flops = 3.5 * 4 * bench_utils.visible_pairs(seqlen, seqlen, True) * args.head_dim * args.heads

    # Ours on one GPU, the whole sequence: rank 0 alone while the others wait.
    if rank == 0 and not args.skip_single:
        single = [t.clone().requires_grad_() for t in whole[:3]]
        row["single_ms"] = bench_utils.median_ms(_training_step(tile_fmha_with_backward, single, whole[3]))
        del single
    dist.barrier()

    row["ours_ms"] = _step_ms(_training_step(context_parallel_attention, leaves, d_out), args.steps)
    out = context_parallel_attention(*leaves).detach()
    # The collectives alone: the keys' and values' all-gather and the float32 reduce-scatter of
    # their gradients.
    local = torch.cat([leaves[1], leaves[2]], dim=-1).detach().movedim(2, 0).contiguous()
    grads = torch.ones((world * local.shape[0], *local.shape[1:]), device="cuda", dtype=torch.float32)
    row["collectives_ms"] = _step_ms(lambda: (all_gather(local, None), reduce_scatter(grads, None)), args.steps)
    row["ours_tflops_per_gpu"] = flops / world / (row["ours_ms"] * 1e-3) / 1e12
    row["kernels_ms"] = _step_ms(_kernels_only(leaves, d_out, sharding, rank), args.steps)
    row.update(_torch_ring(leaves, d_out, out, args, world))
    return row


def _measure_packed(tokens: int, args, rank: int, world: int) -> dict:
    """A packed batch of documents drawn as bench_varlen draws them (lengths in [128,
    --packed-max]), each cut to a multiple of 2W, every document split over the ranks."""
    import torch
    import torch.distributed as dist

    from tests.benchmark.bench_varlen import MIN_LEN, SEED, draw_lengths
    from tilegym import tile_fmha_varlen
    from tilegym.parallel import context_parallel_attention_varlen, shard_packed

    step = 2 * world
    lengths = [max(step, n - n % step) for n in draw_lengths(tokens, MIN_LEN, args.packed_max, SEED)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total, longest = int(cu[-1]), max(lengths)
    generator = torch.Generator(device="cuda").manual_seed(0)

    def draw(heads):
        return torch.randn((total, heads, args.head_dim), device="cuda", dtype=torch.bfloat16, generator=generator)

    whole = [draw(args.heads), draw(args.kv_heads), draw(args.kv_heads), draw(args.heads)]
    shares = [shard_packed(t, cu) for t in whole]
    leaves = [t.clone().requires_grad_() for t in shares[:3]]
    row = {"seqlen": total, "world": world, "documents": len(lengths), "longest": longest}
    pairs = sum(bench_utils.visible_pairs(n, n, True) for n in lengths)
    flops = 3.5 * 4 * pairs * args.head_dim * args.heads

    if rank == 0 and not args.skip_single:
        single = [t.clone().requires_grad_() for t in whole[:3]]
        row["single_ms"] = bench_utils.median_ms(
            _training_step(lambda q, k, v: tile_fmha_varlen(q, k, v, cu, cu, longest, longest), single, whole[3])
        )
        del single
    dist.barrier()
    attention = lambda q, k, v: context_parallel_attention_varlen(q, k, v, cu, longest)  # noqa: E731
    row["ours_ms"] = _step_ms(_training_step(attention, leaves, shares[3]), args.steps)
    row["ours_tflops_per_gpu"] = flops / world / (row["ours_ms"] * 1e-3) / 1e12
    return row


def _kernels_only(leaves, d_out, sharding, rank):
    """The attention calls of one step alone, on keys gathered beforehand, each chunk's keys its
    own leaf: what the kernels cost, without the collectives and the gradients' way back."""
    from tilegym import tile_fmha_with_backward
    from tilegym.parallel import context

    q, k, v = leaves
    whole = context.whole_keys(k.detach(), v.detach(), sharding, None)
    keys, values = whole[..., : k.shape[-1]], whole[..., k.shape[-1] :]
    calls = []
    for span in sharding.spans(rank):
        seen = context._keys_seen(span, True, None, sharding.length)
        rows = (span.local_start, span.length)
        call = [t.detach().clone().requires_grad_() for t in (q.narrow(2, *rows), keys[:, :, seen], values[:, :, seen])]
        calls.append((call, d_out.narrow(2, *rows)))

    def step():
        for call, grad in calls:
            tile_fmha_with_backward(*call).backward(grad)

    return step


def _torch_ring(leaves, d_out, our_out, args, world) -> dict:
    """PyTorch's context parallelism on the same shares: SDPA inside context_parallel, cuDNN."""
    import torch
    import torch.nn.functional as F

    if args.heads != args.kv_heads:
        return {"torch_ring": "skipped: SDPA's ring attention takes Hq == Hkv"}
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.nn.attention import SDPBackend, sdpa_kernel

        mesh = init_device_mesh("cuda", (world,))
        theirs = [t.detach().clone().requires_grad_() for t in leaves]
        # The context shards at least one buffer of the whole sequence (its choice of layout
        # follows from it): a position table, unused here.
        positions = torch.arange(leaves[0].shape[2] * world, device="cuda")[None]

        def attention(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        with (
            sdpa_kernel(SDPBackend.CUDNN_ATTENTION),
            context_parallel(mesh, buffers=[positions], buffer_seq_dims=[1], no_restore_buffers={positions}),
        ):
            their_out = attention(*theirs).detach()
            ms = _step_ms(_training_step(attention, theirs, d_out), args.steps)
        return {"torch_ring_ms": ms, "torch_ring_max_diff": float((their_out.float() - our_out.float()).abs().max())}
    except Exception as error:  # an anchor that does not run on this PyTorch is reported, not fatal
        import traceback

        traceback.print_exc()
        return {"torch_ring": f"unavailable: {type(error).__name__}: {str(error)[:200]}"}


def _table(rows: list) -> str:
    lines = [
        "| GPUs | S | one GPU ms | ours ms | speedup | TFLOPS per GPU | kernels ms | collectives ms | PyTorch ring ms"
        " | ring / ours |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        single, ours, ring = row.get("single_ms"), row["ours_ms"], row.get("torch_ring_ms")
        cells = [
            str(row["world"]), str(row["seqlen"]), f"{single:.1f}" if single else "-", f"{ours:.1f}",
            f"{single / ours:.2f}x" if single else "-", f"{row['ours_tflops_per_gpu']:.0f}",
            f"{row['kernels_ms']:.1f}" if "kernels_ms" in row else "-",
            f"{row['collectives_ms']:.2f}" if "collectives_ms" in row else "-",
            f"{ring:.1f}" if ring else row.get("torch_ring", "-"),
            f"{ring / ours:.2f}x" if ring else "-",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=bench_utils.HelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[32768, 65536, 131072], help="whole sequence lengths")
    p.add_argument("--heads", type=int, default=16, help="query heads (hidden 2048 at D=128)")
    p.add_argument("--kv-heads", type=int, default=16, help="key/value heads")
    p.add_argument("--head-dim", type=int, default=128, help="D")
    p.add_argument("--steps", type=int, default=5, help="timed steps per cell, after 2 of warm-up")
    p.add_argument(
        "--packed-max",
        type=int,
        default=0,
        help="if set, packed batches of documents of 128 to this many tokens instead of one sequence",
    )
    p.add_argument("--skip-single", action="store_true", help="leave out the single-GPU baseline")
    p.add_argument("--json", type=Path, help="write the rows here (rank 0)")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    rows = []
    for seqlen in args.seqlens:
        measure = _measure_packed if args.packed_max else _measure
        rows.append(measure(seqlen, args, rank, world))
        if rank == 0:
            print(json.dumps(rows[-1]), flush=True)
    if rank == 0:
        print(_table(rows))
        if args.json:
            args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
