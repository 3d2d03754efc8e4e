"""Host time to issue one training call (perf-notes#host-work-memoized, #prepared-launches), two ways.

Cases: the training benchmark's two shortest rows, a gpt-oss-like layer (learnable sinks, a
128-key window, GQA 8:1) and a packed batch (bench_varlen.py's lengths, one tensor as both
cumulative lengths). On a GPU, ours and an anchor (SDPA's cuDNN backend; varlen_attn for the
packed batch; none with sinks): the forward, the backward (`torch.autograd.grad` on a kept graph)
and both, with the GPU kept asleep so that only the host is timed, the median of rounds of
back-to-back calls. The host's own time moves by up to half between processes, so compare trees
in alternating processes, several each:

    python tests/benchmark/host_time.py

With --stubbed, any machine, no GPU: our launch path alone (`launch.forward` then
`launch.backward`, with the sinks' gradient where there are sinks) with cuTile's launch and the
GPU's facts stubbed, on CPU tensors, the least of rounds; steadier than the GPU machine's host,
for comparing trees:

    python tests/benchmark/host_time.py --stubbed

After the first calls ours replay their prepared launches; --unprepared (either way) drops the
plans before each call, timing the launch path that builds them:

    python tests/benchmark/host_time.py [--stubbed] --unprepared

With --parts, on a GPU, the plain rows also time where ours goes: a bare autograd.Function that
allocates and saves as ours does and launches nothing (the floor any Python function pays), ours
with cuTile's launch replaced by one that does nothing, and cuTile's launch itself, per launch;
and every row (ours only where prepared) adds the forward and the backward as timed within
back-to-back fwd+bwd calls ("alternating"), where each follows the other's work. The backward
runs on autograd's device thread; pinned to one core, the process keeps both threads' work on
one core's caches:

    python tests/benchmark/host_time.py --parts
    taskset -c 4 python tests/benchmark/host_time.py --parts

Prints microseconds per call; writes no files.
"""

import argparse
import contextlib
import itertools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmark import bench_utils  # noqa: E402
from tests.benchmark.bench_utils import Shape  # noqa: E402

# The training benchmark's shortest rows, where a call's host time nears its GPU time, and a
# gpt-oss-like layer: learnable sinks, a 128-key window, GQA 8:1 (bench_attention_variants.py's
# window128-sinks row; only ours runs it).
SHAPES = [
    Shape(16, 16, 16, 1024, 1024, 128, True, "bfloat16"),
    Shape(16, 32, 32, 1024, 1024, 64, False, "bfloat16"),
    Shape(4, 32, 4, 4096, 4096, 64, True, "bfloat16", "window128-sinks"),
]
# A packed batch: bench_varlen.py's drawn lengths, one tensor as both cumulative lengths (as
# self-attention passes them), D=128, causal; against PyTorch's varlen_attn.
PACKED_SHAPE = Shape(1, 16, 16, 16384, 16384, 128, True, "bfloat16")
_ASLEEP_CYCLES = 300_000_000  # about 0.17 s of GPU time: longer than a round of calls takes to issue


def _label(shape: Shape) -> str:
    return f"B={shape.batch} H={shape.q_heads} S={shape.seqlen_q} {shape.series}"


def _drawn_lengths() -> list[int]:
    from tests.benchmark import bench_varlen

    return bench_varlen.draw_lengths(bench_utils.TOKENS, bench_varlen.MIN_LEN, bench_varlen.MAX_LEN, bench_varlen.SEED)


def _rounds_us(call, calls: int, rounds: int, asleep: bool) -> list[float]:
    """Microseconds per call of each round of `calls` back-to-back calls."""
    import torch

    times = []
    for _ in range(rounds):
        if asleep:
            torch.cuda._sleep(_ASLEEP_CYCLES)
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls * 1e6)
        if asleep:
            torch.cuda.synchronize()
    return sorted(times)


def _alternating_us(attention, inputs: tuple, d_out, calls: int, rounds: int) -> tuple[float, float]:
    """Back-to-back fwd+bwd calls timed by part (in _rounds_us's rounds): the medians over rounds
    of the host us per call of the forward and of the backward (torch.autograd.grad), each
    following the other."""
    import torch

    parts = []  # (forward, backward) seconds of each call, round after round

    def call():
        start = time.perf_counter()
        out = attention(*inputs)
        middle = time.perf_counter()
        torch.autograd.grad(out, inputs, d_out)
        parts.append((middle - start, time.perf_counter() - middle))

    _rounds_us(call, calls, rounds, asleep=True)
    each_round = [parts[first : first + calls] for first in range(0, len(parts), calls)]
    forward, backward = (sorted(sum(p[i] for p in r) / calls * 1e6 for r in each_round) for i in (0, 1))
    return forward[rounds // 2], backward[rounds // 2]


def _training_calls(attention, inputs: tuple, d_out, unprepared: bool) -> dict:
    """The forward, the backward of one kept graph, and both, as calls without arguments;
    unprepared: each after dropping the prepared launches."""
    import torch

    from tilegym.ops.attention import prepared

    out = attention(*inputs)
    calls = {
        "fwd": lambda: attention(*inputs),
        "bwd": lambda: torch.autograd.grad(out, inputs, d_out, retain_graph=True),
        "fwd+bwd": lambda: torch.autograd.grad(attention(*inputs), inputs, d_out),
    }
    if not unprepared:
        return calls
    return {mode: lambda call=call: (prepared._plans.clear(), call()) for mode, call in calls.items()}


def _bare_function():
    """attention(q, k, v) through an autograd.Function that allocates and saves as ours does
    (out and the LSE; the gradients) and launches nothing."""
    import torch

    class Bare(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.set_materialize_grads(False)
            return out, lse

        @staticmethod
        def backward(ctx, d_out, d_lse):
            q, k, v, _, _ = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    return lambda q, k, v: Bare.apply(q, k, v)[0]


@contextlib.contextmanager
def _launch_replaced(replacement):
    """cuTile's launch replaced, within the block, by replacement(launch) (launch: the real one)."""
    import cuda.tile as ct

    launch = ct.launch
    ct.launch = replacement(launch)
    try:
        yield
    finally:
        ct.launch = launch


def _timed_launches(attention, inputs: tuple, calls: int) -> str:
    """cuTile's launch during fwd+bwd calls of ours: launches per call and host us per launch."""
    import torch

    spent = []

    def timed(launch):
        def timed_launch(*args, **kwargs):
            start = time.perf_counter()
            launch(*args, **kwargs)
            spent.append(time.perf_counter() - start)

        return timed_launch

    d_out = torch.randn_like(inputs[0])
    with _launch_replaced(timed):
        torch.cuda._sleep(_ASLEEP_CYCLES)
        for _ in range(calls):
            torch.autograd.grad(attention(*inputs), inputs, d_out)
        torch.cuda.synchronize()
    spent.sort()
    return f"{len(spent) / calls:.0f} launches per fwd+bwd, median {spent[len(spent) // 2] * 1e6:.1f} us each"


def _on_the_gpu(calls: int, rounds: int, unprepared: bool, parts: bool) -> None:
    import torch

    from tests.benchmark import bench_varlen

    def timed(label: str, provider: str, attention, inputs: tuple) -> None:
        d_out = torch.randn_like(inputs[0])
        for _ in range(3):  # compiles and tunes outside the timing
            torch.autograd.grad(attention(*inputs), inputs, d_out)
        torch.cuda.synchronize()
        modes = _training_calls(attention, inputs, d_out, unprepared and provider == "cutile")
        medians = {mode: _rounds_us(call, calls, rounds, asleep=True) for mode, call in modes.items()}
        row = "  ".join(f"{mode} {times[len(times) // 2]:6.0f}" for mode, times in medians.items())
        if parts and not (unprepared and provider == "cutile"):  # the alternating calls are prepared
            forward, backward = _alternating_us(attention, inputs, d_out, calls, rounds)
            row += f"  alternating: fwd {forward:6.0f}  bwd {backward:6.0f}"
        if unprepared and provider == "cutile":
            provider = "unprepared"
        print(f"{label:36s} {provider:11s} host us per call, median of {rounds} rounds: {row}", flush=True)

    for shape in SHAPES:
        inputs = bench_utils.make_inputs(shape, requires_grad=True)
        for provider in ("cutile", "cudnn"):
            try:
                attention = bench_utils.attention_fn(provider, shape, True, bench_utils.option_kwargs(shape))
            except bench_utils.Unavailable:
                continue
            timed(_label(shape), provider, attention, inputs)
        if parts and not shape.option:
            timed(_label(shape), "bare", _bare_function(), inputs)
            ours = bench_utils.attention_fn("cutile", shape, True)
            with _launch_replaced(lambda launch: lambda *args, **kwargs: None):
                timed(_label(shape), "no launch", ours, inputs)
            print(f"{_label(shape):36s} cuTile's launch: {_timed_launches(ours, inputs, calls)}", flush=True)
    batch = bench_varlen.pack(_drawn_lengths())
    inputs = bench_varlen.packed_inputs(PACKED_SHAPE, batch, bench_varlen.SEED)
    label = f"packed {len(batch.lengths)} sequences {PACKED_SHAPE.series}"
    timed(label, "cutile", bench_varlen.ours_varlen(PACKED_SHAPE, batch), inputs)
    try:
        timed(label, "varlen_attn", bench_varlen.torch_varlen(PACKED_SHAPE, batch), inputs)
    except bench_utils.Unavailable as why:
        print(f"{label:36s} varlen_attn unavailable: {why}")


def _launch_path(launch, problem, q, k, v, d_out, unprepared: bool, mod_tensors=None, cu_seqlens=None):
    """launch.forward, then launch.backward (with the sinks' gradient where there are sinks), of
    one problem, as a call without arguments; unprepared: each without a prepared launch."""
    from tilegym.ops.attention import prepared
    from tilegym.ops.attention.score_mods import NO_TENSORS

    mod_tensors = mod_tensors or NO_TENSORS
    sinks_grad = mod_tensors.sinks is not None

    def step():
        if unprepared:
            prepared._plans.clear()
        out, lse = launch.forward(q, k, v, problem, True, None, None, mod_tensors, cu_seqlens)
        if unprepared:
            prepared._plans.clear()
        launch.backward(
            d_out, q, k, v, out, lse, problem, None, mod_tensors, sinks_grad=sinks_grad, cu_seqlens=cu_seqlens
        )  # fmt: skip

    return step


def _stubbed(calls: int, rounds: int, unprepared: bool) -> None:
    os.environ["DISABLE_AUTOTUNE"] = "1"  # each kernel's first config: tuning would time on a GPU
    import cuda.tile as ct
    import torch

    from tilegym import cuda_context, launching
    from tilegym.ops.attention import launch
    from tilegym.ops.attention.packing import CuSeqlens
    from tilegym.ops.attention.problem import AttentionProblem, Packing
    from tilegym.ops.attention.score_mods import ModTensors, ScoreMods

    launching.device_facts = lambda index: ("NVIDIA H100 80GB HBM3", "sm_90", ct.__version__)
    launching.current_stream_handle = lambda index: 0
    cuda_context.ensure_current = lambda index: None
    ct.launch = lambda stream, grid, kernel, arguments: None
    lengths = _drawn_lengths()
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    cases = [(_label(shape), shape, None, None) for shape in SHAPES]
    cases.append((f"packed {len(lengths)} sequences {PACKED_SHAPE.series}", PACKED_SHAPE, lengths, cu_seqlens))
    for label, shape, packed_lengths, cu in cases:
        dtype = getattr(torch, shape.dtype)
        window = bench_utils.option_window(shape)
        sinks = "sinks" in shape.option
        mods = ScoreMods(window=window, sinks=sinks)
        mod_tensors = ModTensors(sinks=torch.randn(shape.q_heads)) if sinks else None
        packing, seqlen, batch = None, shape.seqlen_q, shape.batch
        if packed_lengths:
            packing, seqlen, batch = Packing(shape.seqlen_q, shape.seqlen_k), max(packed_lengths), len(packed_lengths)
        problem = AttentionProblem(
            batch, shape.q_heads, shape.kv_heads, seqlen, seqlen, shape.head_dim, dtype, shape.head_dim**-0.5,
            shape.causal, mods, packing=packing,
        )  # fmt: skip
        # Small tensors: the launch path reads their layout, the stubbed launch nothing else.
        q, out_grad = (torch.randn(1, shape.q_heads, 16, shape.head_dim, dtype=dtype) for _ in range(2))
        k, v = (torch.randn(1, shape.kv_heads, 16, shape.head_dim, dtype=dtype) for _ in range(2))
        lengths_pair = None if cu is None else CuSeqlens(cu, cu)
        step = _launch_path(launch, problem, q, k, v, out_grad, unprepared, mod_tensors, lengths_pair)
        for _ in range(10):
            step()
        times = _rounds_us(step, calls, rounds, asleep=False)
        path = "unprepared" if unprepared else "stubbed"
        print(f"{label:36s} launch.forward + launch.backward, {path}: {times[0]:6.1f} us (least of {rounds})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=bench_utils.HelpFormatter)
    p.add_argument("--stubbed", action="store_true", help="time our launch path alone, without a GPU")
    p.add_argument("--unprepared", action="store_true", help="ours without prepared launches")
    p.add_argument(
        "--parts",
        action="store_true",
        help="on a GPU: a bare Function, ours without launches, a launch; fwd and bwd alternating",
    )
    p.add_argument("--calls", type=int, default=40, help="back-to-back calls per round")
    p.add_argument("--rounds", type=int, default=7, help="rounds per measurement")
    args = p.parse_args()
    if args.stubbed:
        _stubbed(args.calls, args.rounds, args.unprepared)
    else:
        _on_the_gpu(args.calls, args.rounds, args.unprepared, args.parts)


if __name__ == "__main__":
    main()
