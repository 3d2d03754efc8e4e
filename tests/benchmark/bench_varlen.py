"""Packed variable-length attention for training (tilegym.tile_fmha_varlen): forward, backward
and forward + backward of one batch of 16384 tokens packed from lengths drawn uniformly in
[128, 4096], against our dense kernel on as many tokens at the batch's mean length, PyTorch's
varlen_attn, and SDPA on cuDNN over the batch padded to its longest sequence with a padding
mask (the pad and unpad copies timed with it: the user pays them).

    python tests/benchmark/bench_varlen.py --quick
    python tests/benchmark/bench_varlen.py
    python tests/benchmark/bench_varlen.py --head-dims 128 --causal true --gqa --json bench-out/varlen_gqa.json
    python tests/benchmark/bench_varlen.py --replot docs/benchmarks/h100/attention_varlen.json

Hidden 2048 (Hq = 2048 / D), Hkv = Hq unless --gqa adds GQA 8:1 rows. TFLOPS count the
query-key pairs each sequence has, L (L + 1) / 2 causal and L^2 full, times 4 D Hq for the
forward, 2.5x that for the backward and 3.5x for both; cuDNN padded is credited the same pairs
as ours (an effective rate for the same tokens), the dense kernel its own B sequences of S.
"fwd" is the training forward (inputs require grad, so each provider saves what its backward
needs); "bwd" differentiates one saved forward again and again (retain_graph).

Targets, judged on forward + backward: ours / dense-at-mean TFLOPS >= 0.95, varlen_attn's time /
ours >= 1.2, cuDNN padded's time / ours >= 1.5. The last table is Markdown for the README.
"""

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass, replace
from itertools import accumulate
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmark import bench_utils  # noqa: E402
from tests.benchmark.bench_utils import Result, Shape  # noqa: E402

PREFIX = "attention_varlen"
MODES = tuple(bench_utils.MODE_FLOP_FACTOR)
PROVIDERS = ("ours-varlen", "ours-dense-mean", "varlen_attn", "cudnn-padded")
PROVIDER_LABELS = {
    "ours-varlen": "ours, packed (tile_fmha_varlen)",
    "ours-dense-mean": "ours, dense at the mean length",
    "varlen_attn": "PyTorch varlen_attn",
    "cudnn-padded": "SDPA cuDNN, padded + mask",
}
# The providers that take the packed batch; the dense one takes B x S of its own.
PACKED = ("ours-varlen", "varlen_attn", "cudnn-padded")
# Each comparison with ours-varlen: (other provider, its short name, ratio's title, target),
# judged on TARGET_MODE. The dense kernel compares TFLOPS (its pairs differ); the others time
# on the same tokens.
TARGETS = (
    ("ours-dense-mean", "dense at mean", "ours / dense TFLOPS", 0.95),
    ("varlen_attn", "varlen_attn", "varlen_attn / ours time", 1.2),
    ("cudnn-padded", "cuDNN padded", "cuDNN padded / ours time", 1.5),
)
TARGET_MODE = "fwd+bwd"
# The dense length is the mean rounded to this: a whole number of our tiles, as a model would pick.
DENSE_MULTIPLE = 64
# The drawn lengths' range and seed by default: the README's table.
MIN_LEN, MAX_LEN, SEED = 128, 4096, 0
# Correctness before timing: the packed output's first sequences against SDPA per sequence.
CHECK_SEQUENCES = 3
CHECK_ABOVE = 2e-2
# As the other benchmarks: results go to bench-out/, and a run worth keeping is copied to
# docs/benchmarks/h100/ by hand.
DEFAULT_JSON = Path("bench-out") / f"{PREFIX}.json"


# ---- the batch ----------------------------------------------------------------------------------


def draw_lengths(tokens: int, min_len: int, max_len: int, seed: int) -> list[int]:
    """Lengths drawn uniformly in [min_len, max_len] until the next would pass `tokens`; that one
    is cut to fill the batch exactly (so it may be shorter than min_len, never below 1). A fixed
    seed gives every run and every cell the same batch."""
    rng = random.Random(seed)
    lengths, total = [], 0
    while total < tokens:
        length = min(rng.randint(min_len, max_len), tokens - total)
        lengths.append(length)
        total += length
    return lengths


def dense_length(lengths: list[int]) -> tuple[int, int]:
    """(B, S) of the dense anchor: S the mean length rounded to DENSE_MULTIPLE, B sequences of it
    holding about as many tokens as the packed batch."""
    tokens = sum(lengths)
    seqlen = max(DENSE_MULTIPLE, round(tokens / len(lengths) / DENSE_MULTIPLE) * DENSE_MULTIPLE)
    return max(1, round(tokens / seqlen)), seqlen


def pair_count(lengths, causal: bool) -> int:
    """Query-key pairs the sequences have: causal L (L + 1) / 2 each (bottom-right with Lq = Lk is
    ordinary causal), full L^2."""
    return sum(length * (length + 1) // 2 if causal else length * length for length in lengths)


def describe_lengths(lengths: list[int], meta: dict | None = None) -> str:
    """One line on the batch, and the dense anchor's shape."""
    batch, seqlen = dense_length(lengths)
    drawn = ""
    if meta and "min_len" in meta:
        drawn = f" (uniform in [{meta['min_len']}, {meta['max_len']}], seed {meta['seed']})"
    return (
        f"{len(lengths)} sequences{drawn}, {sum(lengths)} tokens: mean {sum(lengths) / len(lengths):.0f}, "
        f"max {max(lengths)}, min {min(lengths)}; dense at the mean: B={batch} x S={seqlen}"
    )


@dataclass
class Packed:
    """The packed batch on the GPU: cu_seqlens as varlen kernels take it, and each token's row in
    the padded [N * max_len] layout for the pad and unpad copies."""

    lengths: list[int]
    cu_seqlens: object  # int32 [N + 1] on the GPU
    padded_rows: object  # int64 [total] on the GPU

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    @property
    def starts(self) -> list[int]:
        return [0, *accumulate(self.lengths)]


def pack(lengths: list[int]) -> Packed:
    import torch

    sizes = torch.tensor(lengths)
    starts = torch.tensor([0, *accumulate(lengths)])
    sequence = torch.repeat_interleave(torch.arange(len(lengths)), sizes)
    position = torch.arange(int(sizes.sum())) - starts[sequence]
    rows = sequence * max(lengths) + position
    return Packed(lengths, starts.to("cuda", torch.int32), rows.cuda())


def packed_shape(shape: Shape, batch: Packed) -> Shape:
    """How a packed cell is recorded in the JSON file: batch = sequences, seqlen = the longest (the
    padded length); the lengths themselves are in the file's meta."""
    return replace(shape, batch=len(batch.lengths), seqlen_q=batch.max_len, seqlen_k=batch.max_len)


def dense_shape(shape: Shape, lengths: list[int]) -> Shape:
    batch, seqlen = dense_length(lengths)
    return replace(shape, batch=batch, seqlen_q=seqlen, seqlen_k=seqlen)


def packed_inputs(shape: Shape, batch: Packed, seed: int):
    """q [total, Hq, D] and k, v [total, Hkv, D], requiring grad: every mode is of training."""
    import torch

    generator = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(batch.lengths)

    def tensor(heads):
        t = torch.randn(total, heads, shape.head_dim, device="cuda", dtype=getattr(torch, shape.dtype),
                        generator=generator)  # fmt: skip
        return t.requires_grad_(True)

    return tensor(shape.q_heads), tensor(shape.kv_heads), tensor(shape.kv_heads)


# ---- providers ----------------------------------------------------------------------------------


def ours_varlen(shape: Shape, batch: Packed):
    from tilegym import tile_fmha_varlen

    cu, longest = batch.cu_seqlens, batch.max_len
    return lambda q, k, v: tile_fmha_varlen(q, k, v, cu, cu, longest, longest, is_causal=shape.causal)


def ours_dense(shape: Shape):
    from tilegym import tile_fmha_with_backward

    return lambda q, k, v: tile_fmha_with_backward(q, k, v, is_causal=shape.causal)


def torch_varlen(shape: Shape, batch: Packed):
    """PyTorch's varlen_attn. Its causal flag moved: PyTorch 2.9 and 2.10 take is_causal, later
    versions window_size=(-1, 0) (keyword-only); GQA needs enable_gqa, which came later still."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as error:
        raise bench_utils.Unavailable(f"torch.nn.attention.varlen not in this PyTorch ({error})") from None
    parameters = inspect.signature(varlen_attn).parameters
    kwargs = {}
    if "is_causal" in parameters:
        kwargs["is_causal"] = shape.causal
    elif "window_size" in parameters:
        kwargs["window_size"] = (-1, 0) if shape.causal else (-1, -1)
    elif shape.causal:
        raise bench_utils.Unavailable("this varlen_attn takes neither is_causal nor window_size")
    if shape.kv_heads != shape.q_heads:
        if "enable_gqa" not in parameters:
            raise bench_utils.Unavailable("this varlen_attn has no enable_gqa")
        kwargs["enable_gqa"] = True
    cu, longest = batch.cu_seqlens, batch.max_len
    return lambda q, k, v: varlen_attn(q, k, v, cu, cu, longest, longest, **kwargs)


def padding_masks(shape: Shape, batch: Packed) -> list[tuple[str, object]]:
    """[N, 1, max_len, max_len] masks that hide padded keys (and later keys when causal): boolean
    first, then the same as an additive float mask, for a cuDNN that refuses the boolean one.
    No row is fully hidden (every sequence has a key 0), so padded rows stay finite."""
    import torch

    position = torch.arange(batch.max_len, device="cuda")
    lengths = torch.tensor(batch.lengths, device="cuda")
    keep = (position[None, :] < lengths[:, None])[:, None, None, :]  # [N, 1, 1, max_len]
    if shape.causal:
        keep = keep & (position[None, :] <= position[:, None])
    keep = keep.expand(len(batch.lengths), 1, batch.max_len, batch.max_len).contiguous()
    additive = torch.zeros(keep.shape, device="cuda", dtype=getattr(torch, shape.dtype))
    return [("bool", keep), ("additive", additive.masked_fill_(~keep, float("-inf")))]


def padded_cudnn(shape: Shape, batch: Packed, mask):
    """SDPA on cuDNN over the batch padded to [N, H, max_len, D]: scatter the packed tokens into
    zeros, attend with the mask, gather the real rows back; all three are differentiable and timed."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    count, longest, rows = len(batch.lengths), batch.max_len, batch.padded_rows
    gqa = shape.q_heads != shape.kv_heads

    def pad(t):
        zeros = t.new_zeros(count * longest, t.shape[1], t.shape[2])
        return zeros.index_copy(0, rows, t).view(count, longest, t.shape[1], t.shape[2]).transpose(1, 2)

    def attention(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(count * longest, out.shape[1], out.shape[3]).index_select(0, rows)

    return attention


def cudnn_padded(shape: Shape, batch: Packed, inputs, training: bool):
    """(function, mask kind) for the first mask cuDNN takes, forward and (training) backward."""
    import torch

    refusals = []
    for kind, mask in padding_masks(shape, batch):
        fn = padded_cudnn(shape, batch, mask)
        try:
            out = fn(*inputs)
            if training:
                torch.autograd.grad(out, inputs, torch.randn_like(out))
            torch.cuda.synchronize()
            return fn, kind
        except RuntimeError as error:
            refusals.append(f"{kind}: {_first_line(error)}")
    raise bench_utils.Unavailable("cuDNN refused the padding mask; " + "; ".join(refusals))


def provider_function(provider: str, shape: Shape, batch: Packed, inputs, training: bool):
    """(function (q, k, v) -> out, note) of a provider, or raises Unavailable."""
    if provider == "ours-varlen":
        try:
            return ours_varlen(shape, batch), ""
        except ImportError as error:
            raise bench_utils.Unavailable(f"tilegym.tile_fmha_varlen not importable ({error})") from None
    if provider == "ours-dense-mean":
        return ours_dense(shape), ""
    if provider == "varlen_attn":
        return torch_varlen(shape, batch), ""
    fn, kind = cudnn_padded(shape, batch, inputs, training)
    return fn, f"{kind} mask"


# ---- correctness --------------------------------------------------------------------------------


def packed_error(out, q, k, v, batch: Packed, causal: bool) -> float:
    """Max abs error of a packed output on its first CHECK_SEQUENCES sequences against SDPA in
    fp32 run on each sequence alone: cheap, and a wrong sequence boundary or mask shows there."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    error = 0.0
    starts = batch.starts
    for index in range(min(CHECK_SEQUENCES, len(batch.lengths))):
        rows = slice(starts[index], starts[index + 1])
        q1, k1, v1 = _one_sequence(q, rows), _one_sequence(k, rows, group), _one_sequence(v, rows, group)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            expected = F.scaled_dot_product_attention(q1, k1, v1, is_causal=causal)
        got = out.detach()[rows].float()
        error = max(error, (got - expected[0].transpose(0, 1)).abs().max().item())
    return error


def _one_sequence(packed, rows: slice, repeat: int = 1):
    """[1, H * repeat, L, D] fp32 of one sequence's rows of a packed [total, H, D] tensor; repeat
    gives each query head of a group its key/value head."""
    return packed.detach()[rows].float().transpose(0, 1).repeat_interleave(repeat, dim=0)[None]


def check(provider: str, out, inputs, shape: Shape, batch: Packed) -> tuple[float, float]:
    """(max error, limit) of a provider's output: packed ones as packed_error, the dense one
    against the fp32 reference as the other benchmarks check it."""
    if provider in PACKED:
        return packed_error(out, *inputs, batch, shape.causal), CHECK_ABOVE
    dense = dense_shape(shape, batch.lengths)
    return bench_utils.check_output(out, *inputs, dense), bench_utils.WRONG_ABOVE[shape.dtype]


# ---- timing -------------------------------------------------------------------------------------


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:120] if text else ''}"


# What a provider raises when it cannot run a cell: out of memory, no kernel for the shape or
# dtype, an argument this version does not take. Recorded as a note; the run goes on.
FAILURES = (RuntimeError, ValueError, TypeError, NotImplementedError, ImportError)


def time_mode(result: Result, fn, inputs, out, d_out, pairs: int, tokens: int) -> None:
    """Fill result's ms, TFLOPS, GBps and host time for its mode, or its note on failure."""
    import torch

    calls = {
        "fwd": lambda: fn(*inputs),
        "fwd+bwd": lambda: torch.autograd.grad(fn(*inputs), inputs, d_out),
        # retain_graph: the same forward graph is differentiated at every repetition.
        "bwd": lambda: torch.autograd.grad(out, inputs, d_out, retain_graph=True),
    }
    call = calls[result.mode]
    try:
        result.ms = bench_utils.median_ms(call)
        if result.ms < bench_utils.HOST_TIMED_BELOW_MS:
            result.host_ms = bench_utils.host_issue_ms(call)
    except FAILURES as error:
        result.ms, result.note = None, f"unavailable: {_first_line(error)}"
        return
    shape = result.shape
    flops = 4.0 * shape.head_dim * shape.q_heads * pairs * bench_utils.MODE_FLOP_FACTOR[result.mode]
    result.tflops = flops / (result.ms * 1e-3) / 1e12
    # The fewest bytes of the real tokens, as one long sequence: the count is linear in tokens.
    real = replace(shape, batch=1, seqlen_q=tokens, seqlen_k=tokens)
    result.gbps = bench_utils.min_bytes(result.mode, real) / (result.ms * 1e-3) / 1e9


def measure_provider(provider: str, shape: Shape, modes, batch: Packed, seed: int) -> list[Result]:
    """One provider on one cell: inputs, a checked first call, then each mode timed. A provider
    that cannot run the cell gets a note on every mode; one mode that fails, on that mode."""
    import torch

    packed = provider in PACKED
    recorded = packed_shape(shape, batch) if packed else dense_shape(shape, batch.lengths)
    results = [Result(mode, provider, recorded) for mode in modes]
    lengths = batch.lengths if packed else [recorded.seqlen_q] * recorded.batch
    try:
        if packed:
            inputs = packed_inputs(shape, batch, seed)
        else:
            inputs = bench_utils.make_inputs(recorded, requires_grad=True, seed=seed)
        training = any(mode != "fwd" for mode in modes)
        with torch.enable_grad():
            fn, note = provider_function(provider, shape, batch, inputs, training)
            out = fn(*inputs)  # warm-up: compiles and tunes outside the timing
            error, limit = check(provider, out, inputs, shape, batch)
            d_out = torch.randn_like(out)
            if not error <= limit:
                print(f"  check failed: {provider} {shape.series}: max abs error {error:.2e} > {limit:.0e}", flush=True)
            for result in results:
                result.max_error, result.wrong, result.note = error, not error <= limit, note
                time_mode(result, fn, inputs, out, d_out, pair_count(lengths, shape.causal), sum(lengths))
    except bench_utils.Unavailable as reason:
        for result in results:
            result.note = f"skipped: {reason}"
    except FAILURES as error:
        for result in results:
            if result.ms is None:
                result.note = f"unavailable: {_first_line(error)}"
    finally:
        torch.cuda.empty_cache()
    return results


def run_all(shapes: list[Shape], modes, providers, lengths: list[int], seed: int) -> list[Result]:
    """Every provider on every cell, one line per cell and mode as each cell finishes."""
    batch = pack(lengths)
    results = []
    for done, shape in enumerate(shapes, 1):
        cell = [r for provider in providers for r in measure_provider(provider, shape, modes, batch, seed)]
        results += cell
        for mode in modes:
            row = "  ".join(f"{r.provider}={_cell(r)}" for r in cell if r.mode == mode)
            print(f"[{done}/{len(shapes)}] {mode:8s} {shape.series:24s} {row}", flush=True)
    return results


# ---- tables -------------------------------------------------------------------------------------


def _timed(result: Result | None) -> bool:
    return result is not None and result.ms is not None


def _cell(result: Result | None) -> str:
    """ms/TFLOPS, * when host-bound, (WRONG) when the check failed."""
    if result is None or result.ms is None:
        return "n/a"
    mark = bench_utils.HOST_BOUND_MARK if result.host_bound else ""
    return f"{result.ms:.2f}/{result.tflops:.0f}{mark}{'(WRONG)' if result.wrong else ''}"


def by_cell(results: list[Result]) -> dict[tuple[str, str], dict[str, Result]]:
    """{(mode, series): {provider: result}} in the order measured."""
    cells: dict[tuple[str, str], dict[str, Result]] = {}
    for result in results:
        cells.setdefault((result.mode, result.shape.series), {})[result.provider] = result
    return cells


def ratio(providers: dict[str, Result], other: str) -> float | None:
    """ours-varlen against `other` as TARGETS compares them (above 1 where ours is better)."""
    ours, theirs = providers.get("ours-varlen"), providers.get(other)
    if not (ours and theirs and ours.ms and theirs.ms):
        return None
    return ours.tflops / theirs.tflops if other == "ours-dense-mean" else theirs.ms / ours.ms


def _ratio_text(value: float | None, target: float, judged: bool) -> str:
    """The ratio to two decimals; a missed target written out, its ratio rounded down so that it
    never reads as the target itself."""
    if value is None:
        return "n/a"
    if judged and value < target:
        return f"{math.floor(value * 100) / 100:.2f}x (below {target})"
    return f"{value:.2f}x"


def table(results: list[Result]) -> str:
    """ms/TFLOPS per provider and ours' ratios, a row per (mode, series); misses of a target
    marked on TARGET_MODE rows; then the notes."""
    providers = [p for p in PROVIDERS if any(r.provider == p for r in results)]
    header = f"{'mode':8s} {'series':24s} " + " ".join(f"{p:>16s}" for p in providers)
    header += "".join(f" {title:>26s}" for _, _, title, _ in TARGETS)
    lines = ["ms/TFLOPS per provider; ratios above 1 where ours-varlen is better", header, "-" * len(header)]
    for (mode, series), cell in by_cell(results).items():
        row = f"{mode:8s} {series:24s} " + " ".join(f"{_cell(cell.get(p)):>16s}" for p in providers)
        for other, _, _, target in TARGETS:
            row += f" {_ratio_text(ratio(cell, other), target, mode == TARGET_MODE):>26s}"
        lines.append(row)
    if any(r.host_bound for r in results):
        lines += ["", bench_utils.HOST_BOUND_NOTE]
    notes = sorted({f"  {r.provider} {r.shape.series}: {r.note}" for r in results if r.note})
    notes += sorted({f"  WRONG: {r.provider} {r.shape.series}: max abs error {r.max_error:.2e}" for r in results
                     if r.wrong})  # fmt: skip
    if notes:
        lines += ["", "notes:", *notes]
    return "\n".join(lines)


def _row_label(shape: Shape) -> str:
    gqa = f", GQA {shape.q_heads // shape.kv_heads}:1" if shape.q_heads != shape.kv_heads else ""
    dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(shape.dtype, shape.dtype)
    return f"{shape.head_dim}, {'causal' if shape.causal else 'full'}, {dtype}{gqa}"


def markdown_table(results: list[Result], mode: str = TARGET_MODE) -> str:
    """The README's table: per (D, mask, dtype) row, each provider's ms and ours' ratio against
    it, misses of a target written out."""
    header = "| D, mask, dtype | ours ms (TFLOPS) |"
    for _, name, title, target in TARGETS:
        header += f" {name} ms | {title} (target >= {target}) |"
    lines = [
        f"{mode}, ms (ours also TFLOPS); ratios above 1 where ours is better:",
        "",
        header,
        "|" + " --- |" * (2 + 2 * len(TARGETS)),
    ]
    marked = False
    for (cell_mode, _), cell in by_cell(results).items():
        if cell_mode != mode:
            continue
        ours = cell.get("ours-varlen")
        any_result = next(iter(cell.values()))
        shape = ours.shape if ours else any_result.shape
        row = f"| {_row_label(shape)} | {_markdown_ms(ours, with_tflops=True)} |"
        for other, _, _, target in TARGETS:
            row += f" {_markdown_ms(cell.get(other))} | {_ratio_text(ratio(cell, other), target, True)} |"
        marked = marked or any(r.host_bound for r in cell.values())
        lines.append(row)
    if marked:
        lines += ["", bench_utils.HOST_BOUND_NOTE]
    return "\n".join(lines)


def _markdown_ms(result: Result | None, with_tflops: bool = False) -> str:
    if result is None or result.ms is None:
        return "n/a"
    mark = bench_utils.HOST_BOUND_MARK if result.host_bound else ""
    wrong = " (WRONG)" if result.wrong else ""
    return f"{result.ms:.2f}{mark}" + (f" ({result.tflops:.0f})" if with_tflops else "") + wrong


# ---- figures ------------------------------------------------------------------------------------


def plot(results: list[Result], out_dir: Path, metas) -> list[Path]:
    """One bar chart of TFLOPS per mode: a group of bars per series, a bar per provider."""
    plt = bench_utils._pyplot()
    providers = [p for p in PROVIDERS if any(r.provider == p for r in results)]
    footer = bench_utils.environment(metas)
    if metas and "lengths" in metas[-1]:
        footer += "\n" + describe_lengths(metas[-1]["lengths"], metas[-1])
    drawn = []
    for mode in [m for m in MODES if any(r.mode == m for r in results)]:
        cells = [(series, cell) for (cell_mode, series), cell in by_cell(results).items() if cell_mode == mode]
        figure, axis = plt.subplots(figsize=(max(6.4, 1.1 * len(cells)), 4.2), layout="constrained")
        width = 0.8 / len(providers)
        for index, provider in enumerate(providers):
            bars = [(i, cell[provider].tflops) for i, (_, cell) in enumerate(cells) if _timed(cell.get(provider))]
            if bars:
                xs, ys = zip(*bars, strict=True)
                offset = (index - (len(providers) - 1) / 2) * width
                axis.bar(
                    [x + offset for x in xs],
                    ys,
                    width,
                    color=f"C{PROVIDERS.index(provider)}",
                    label=PROVIDER_LABELS[provider],
                )
        axis.set_xticks(range(len(cells)), [series for series, _ in cells], rotation=20, ha="right", fontsize=8)
        axis.set_ylabel("TFLOPS (pairs each sequence has)")
        axis.grid(True, axis="y", alpha=0.3)
        if axis.patches:
            axis.legend(fontsize=8)
        figure_name = bench_utils._figure(out_dir, ("attention varlen", mode, "TFLOPS"), mode)
        drawn.append(bench_utils._save(figure, figure_name, footer).path)
    return drawn


# ---- command line -------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=bench_utils.HelpFormatter)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="what to time")
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128],
                   help=f"head dims D; Hq = {bench_utils.HIDDEN} / D")  # fmt: skip
    p.add_argument("--causal", choices=("both", "true", "false"), default="both", help="causal, full or both")
    p.add_argument("--dtypes", nargs="+", choices=("bfloat16", "float16"), default=["bfloat16", "float16"],
                   help="input dtypes")  # fmt: skip
    p.add_argument("--gqa", action="store_true",
                   help=f"also time GQA {bench_utils.GQA_RATIO}:1 rows (Hkv = Hq / {bench_utils.GQA_RATIO}), "
                   "first dtype only")  # fmt: skip
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS), help="what to time")
    p.add_argument("--tokens", type=int, default=bench_utils.TOKENS, help="tokens per packed batch")
    p.add_argument("--min-len", type=int, default=MIN_LEN, help="shortest drawn sequence length")
    p.add_argument("--max-len", type=int, default=MAX_LEN, help="longest drawn sequence length")
    p.add_argument("--seed", type=int, default=SEED, help="seed of the lengths and of the inputs")
    p.add_argument("--quick", action="store_true", help="a smoke run: bf16, D=128, causal only")
    p.add_argument("--json", type=Path, metavar="PATH",
                   help=f"results file (default {DEFAULT_JSON})")  # fmt: skip
    p.add_argument("--plots", type=Path, metavar="DIR",
                   help="draw a TFLOPS bar chart per mode into DIR; without it, no figures (one under "
                   "docs/benchmarks/h100 must be listed in docs/benchmarks/README.md)")  # fmt: skip
    p.add_argument(
        "--replot",
        type=Path,
        metavar="JSON",
        help=f"measure nothing: print the tables of an earlier {PREFIX}.json (and draw --plots)",
    )
    return p


def main() -> None:
    p = parser()
    args = p.parse_args()
    if args.replot:
        results, metas = bench_utils.replot_results(p, [args.replot], PREFIX)
        if "lengths" in metas[-1]:
            print(describe_lengths(metas[-1]["lengths"], metas[-1]))
        report(results, args.plots, metas)
        return
    if not 1 <= args.min_len <= args.max_len or args.tokens < 1:
        p.error("need 1 <= --min-len <= --max-len and --tokens >= 1")
    head_dims, dtypes, causal = args.head_dims, args.dtypes, bench_utils.causal_options(args.causal)
    if args.quick:
        head_dims, dtypes, causal = [128], ["bfloat16"], [True]
    lengths = draw_lengths(args.tokens, args.min_len, args.max_len, args.seed)
    meta = {"benchmark": PREFIX, **bench_utils._environment(), "lengths": lengths, "tokens": args.tokens,
            "min_len": args.min_len, "max_len": args.max_len, "seed": args.seed}  # fmt: skip
    print(describe_lengths(lengths, meta), flush=True)
    # The standard series at one length; each provider sets batch and length for itself.
    shapes = bench_utils.shapes(head_dims, causal, dtypes, seqlens=(max(lengths),), gqa=args.gqa)
    started = time.perf_counter()
    results = run_all(shapes, args.modes, args.providers, lengths, args.seed)
    meta.update({"command": " ".join(bench_utils._argv()), "wall_seconds": round(time.perf_counter() - started, 1)})
    path = args.json or DEFAULT_JSON
    bench_utils.save_json(results, path, meta)
    print()
    report(results, args.plots, [meta])
    print(f"\n{len(results)} measurements in {meta['wall_seconds']:.0f} s; results in {path}")


def report(results: list[Result], plots: Path | None, metas) -> None:
    """The full table, the README's Markdown table, and the figures if asked for."""
    print(table(results))
    print()
    if any(r.mode == TARGET_MODE for r in results):
        print(markdown_table(results))
    else:
        print(f"no {TARGET_MODE} measured: no Markdown table (its targets are judged on {TARGET_MODE})")
    if plots:
        drawn = plot(results, plots, metas)
        print(f"\n{len(drawn)} figures in {plots}")


if __name__ == "__main__":
    main()
