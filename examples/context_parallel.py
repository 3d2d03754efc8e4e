"""One sequence's causal attention trained over several GPUs (context parallelism), checked
against the same call on the whole sequence on one GPU.

    torchrun --nproc-per-node 4 examples/context_parallel.py --seqlen 32768
    python examples/context_parallel.py   # spawns a rank per GPU (two sharing one GPU if alone)

Every rank draws the whole q, k and v from one seed, keeps its share (zigzag layout), runs
forward and backward, and compares its rows of the output and its share of the gradients with
tile_fmha_with_backward on the whole sequence.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from tilegym import requirements, tile_fmha_with_backward
from tilegym.parallel import context_parallel_attention, shard_sequence


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's example lines; shows each option's default."""


def _rank_main(rank: int, world: int, backend: str, args) -> None:
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world)
    generator = torch.Generator(device=device).manual_seed(0)

    def draw(heads):
        shape = (1, heads, args.seqlen, args.head_dim)
        return torch.randn(shape, device=device, dtype=torch.bfloat16, generator=generator)

    whole = [draw(args.heads), draw(args.kv_heads), draw(args.kv_heads)]
    d_out = draw(args.heads)
    shares = [shard_sequence(t).requires_grad_() for t in whole]
    for step in range(args.steps):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = context_parallel_attention(*shares)  # causal over the whole sequence
        out.backward(shard_sequence(d_out))
        torch.cuda.synchronize()
        if rank == 0:
            label = "first step (compile + autotune)" if step == 0 else f"step {step}"
            print(f"{label}: {time.perf_counter() - start:.3f} s on {world} ranks")
        if step < args.steps - 1:
            for t in shares:
                t.grad = None

    leaves = [t.detach().requires_grad_() for t in whole]
    expected = tile_fmha_with_backward(*leaves)
    expected.backward(d_out)
    # Each error relative to the largest value of its tensor on one GPU: bf16 rounding is 4e-3.
    errors = {
        name: (ours.float() - shard_sequence(theirs).float()).abs().max() / theirs.float().abs().max()
        for name, ours, theirs in zip(
            ("out", "dq", "dk", "dv"), (out, *(t.grad for t in shares)), (expected, *(t.grad for t in leaves)),
            strict=True,
        )
    }  # fmt: skip
    for error in errors.values():
        dist.all_reduce(error, op=dist.ReduceOp.MAX)
    if rank == 0:
        print("max |ours - one GPU| / max |one GPU|: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    dist.destroy_process_group()


def _spawned(rank: int, world: int, backend: str, address: str, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=address)
    _rank_main(rank, world, backend, args)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("--seqlen", type=int, default=16384, help="whole sequence length")
    parser.add_argument("--heads", type=int, default=16, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=4, help="key/value heads")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim")
    parser.add_argument("--steps", type=int, default=3, help="training steps to time")
    args = parser.parse_args()
    try:
        requirements.check(0)
    except requirements.RequirementError as missing:
        sys.exit(f"context_parallel: {missing}")
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("nccl")
        _rank_main(dist.get_rank(), dist.get_world_size(), "nccl", args)
        return
    gpus = torch.cuda.device_count()
    world, backend = (gpus, "nccl") if gpus > 1 else (2, "gloo")
    import socket

    with socket.socket() as probe:  # a free port for the ranks' rendezvous
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    torch.multiprocessing.spawn(_spawned, args=(world, backend, port, args), nprocs=world)


if __name__ == "__main__":
    main()
