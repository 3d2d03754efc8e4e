"""Shared pieces of the attention benchmarks: shapes, providers, FLOP and byte counts,
correctness check, timing, result files and plots.

Shapes follow the FlashAttention papers: batch x seqlen = 16384 tokens and hidden 2048,
so H = 2048 / D. Sequence lengths run from 512 to 16384.
"""

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tests.benchmark import first_call as first_call_times

TOKENS = 16384
HIDDEN = 2048
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQLENS = (1024, 4096)
GQA_RATIO = 8

# FLOPs of each mode relative to the forward: the backward does 2.5x its matmul work
# (dV, dP, dS->dQ, dS->dK plus recomputing P), forward + backward 3.5x.
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}

PROVIDERS = ("cutile", "cudnn", "flash", "efficient", "math")
PROVIDER_LABELS = {
    "cutile": "tilegym (cuTile)",
    "cudnn": "SDPA cuDNN",
    "flash": "SDPA FlashAttention-2",
    "efficient": "SDPA mem-efficient",
    "math": "SDPA math",
}
# The math backend materializes [B, H, Sq, Sk] scores and probabilities (and their
# gradients) in fp32; skip it when that would not fit comfortably.
MATH_MEMORY_LIMIT_BYTES = 24 * 2**30


@dataclass(frozen=True)
class Shape:
    batch: int
    q_heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    dtype: str  # "bfloat16" or "float16"
    option: str = ""  # a score modifier of OPTIONS, "" for plain attention

    @property
    def series(self) -> str:
        """Name of the plotted series this shape belongs to (all but the sequence length)."""
        gqa = f"-gqa{self.q_heads // self.kv_heads}" if self.q_heads != self.kv_heads else ""
        option = f"-{self.option}" if self.option else ""
        return f"d{self.head_dim}-{'causal' if self.causal else 'full'}-{self.dtype}{gqa}{option}"


def shapes(head_dims, causal_options, dtypes, seqlens=SEQLENS, gqa=False) -> list[Shape]:
    """The standard series (16384 tokens, hidden 2048), one GQA 8:1 series per head dim if gqa."""
    result = []
    for head_dim in head_dims:
        heads = HIDDEN // head_dim
        kv_options = [heads] + ([heads // GQA_RATIO] if gqa else [])
        for kv_heads in kv_options:
            for causal in causal_options:
                for dtype in dtypes:
                    if kv_heads != heads and dtype != dtypes[0]:
                        continue  # one GQA series per head dim and causal setting is enough
                    for seqlen in seqlens:
                        batch = max(1, TOKENS // seqlen)
                        result.append(Shape(batch, heads, kv_heads, seqlen, seqlen, head_dim, causal, dtype))
    return result


# ---- the backward-speed goal --------------------------------------------------------------------

# The cells the training benchmark's --goal measures: every head dim, causal and full, three
# lengths, bf16; and at D=128, S=16384, causal: GQA 8:1 and a (1024, 0) window.
GOAL_HEAD_DIMS = (64, 96, 128, 256)
GOAL_SEQLENS = (1024, 4096, 16384)
GOAL_EXTRA_SEQLEN = 16384
# FlashAttention-4 (flash-attn-4 4.0.0b36, its Hopper kernels), measured on an H100 80GB HBM3 in
# one process beside ours (bf16, 16384 tokens, hidden 2048, do_bench medians): the target.
# TFLOPS (fwd, bwd, fwd+bwd) by (D, causal, S) ...
FA4_TFLOPS = {
    (128, False, 4096): (684, 569, 594),
    (128, True, 4096): (597, 505, 519),
    (128, False, 16384): (696, 533, 579),
    (128, True, 16384): (653, 602, 538),
    (128, True, 1024): (375, 316, 334),
    (64, True, 4096): (442, 449, 441),
    (64, False, 16384): (544, 537, 548),
    (64, True, 16384): (531, 455, 456),
}
# ... and fwd+bwd milliseconds of causal cells by series name and S.
FA4_FWD_BWD_MS = {
    ("d96-causal-bfloat16", 4096): 2.03,
    ("d256-causal-bfloat16", 4096): 2.73,
    ("d128-causal-bfloat16-gqa8", 16384): 6.41,
    ("d128-causal-bfloat16-window", 16384): 1.11,
}


def goal_shapes() -> list[Shape]:
    """The cells of the goal (GOAL_*), in the standard series' layout (16384 tokens, hidden 2048)."""
    result = shapes(GOAL_HEAD_DIMS, [False, True], ["bfloat16"], GOAL_SEQLENS)
    heads = HIDDEN // 128
    batch = TOKENS // GOAL_EXTRA_SEQLEN
    seqlen = GOAL_EXTRA_SEQLEN
    result.append(Shape(batch, heads, heads // GQA_RATIO, seqlen, seqlen, 128, True, "bfloat16"))
    result.append(Shape(batch, heads, heads, seqlen, seqlen, 128, True, "bfloat16", "window"))
    return result


def goal_summary(results: "list[Result]") -> str:
    """Markdown: each goal cell's fwd / bwd / fwd+bwd, ours against cuDNN (same run) and
    FlashAttention-4's figures, and whether ours is at or above both on every mode."""
    index = {(r.mode, r.shape.series, r.shape.seqlen_q, r.provider): r for r in results}
    cells = sorted({(r.shape.series, r.shape.seqlen_q, r.shape.head_dim, r.shape.causal) for r in results})
    lines = [
        "| series | S | ours TFLOPS fwd / bwd / fwd+bwd | cuDNN | ours / cuDNN | FA4 | ours / FA4 | at or above both |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    modes = tuple(MODE_FLOP_FACTOR)
    for series, seqlen, head_dim, causal in cells:
        ours = [index.get((mode, series, seqlen, "cutile")) for mode in modes]
        cudnn = [index.get((mode, series, seqlen, "cudnn")) for mode in modes]
        fa4 = FA4_TFLOPS.get((head_dim, causal, seqlen)) if series.endswith("-bfloat16") else None
        ours_t = [r.tflops if r and r.tflops else None for r in ours]
        cudnn_t = [r.tflops if r and r.tflops else None for r in cudnn]

        def join(values, fmt="{:.0f}"):
            return " / ".join(fmt.format(v) if v else "-" for v in values)

        vs_cudnn = [o / c if o and c else None for o, c in zip(ours_t, cudnn_t, strict=True)]
        if fa4:
            vs_fa4 = [o / f if o else None for o, f in zip(ours_t, fa4, strict=True)]
            fa4_text = join(fa4)
        else:
            target_ms = FA4_FWD_BWD_MS.get((series, seqlen))
            ours_ms = ours[-1].ms if ours[-1] else None
            vs_fa4 = [None, None, target_ms / ours_ms if target_ms and ours_ms else None]
            fa4_text = f"fwd+bwd {target_ms} ms" if target_ms else "-"
        known = [v for v in vs_cudnn + vs_fa4 if v is not None]
        meets = "yes" if known and all(v >= 1.0 for v in known) else "no" if known else "-"
        lines.append(
            f"| {series} | {seqlen} | {join(ours_t)} | {join(cudnn_t)} | {join(vs_cudnn, '{:.2f}x')} | {fa4_text} | "
            f"{join(vs_fa4, '{:.2f}x')} | {meets} |"
        )
    return "\n".join(lines)


# ---- score modifiers ----------------------------------------------------------------------------

# Each option's keyword arguments, as a model would use them: a trainable full bias, a key
# padding mask (one row per batch, no grad), a 1024-key sliding window, Gemma 2's softcap 30,
# ALiBi with the usual geometric slopes, all of them together, and gpt-oss's layers: learnable
# sinks alone, and with a 128-key window, beside the same window without sinks.
OPTIONS = ("bias", "bias-row", "window", "softcap", "alibi", "all", "sinks", "window128", "window128-sinks")
WINDOW = 1024
SHORT_WINDOW = 128


def option_window(shape: "Shape") -> tuple[int, int] | None:
    """The sliding window an option sets, None for none."""
    if shape.option in ("window", "all"):
        return (WINDOW, 0 if shape.causal else WINDOW)
    if shape.option in ("window128", "window128-sinks"):
        return (SHORT_WINDOW, 0 if shape.causal else SHORT_WINDOW)
    return None


def option_kwargs(shape: Shape) -> dict:
    """The score modifiers of shape.option, on the GPU; {} for plain attention."""
    import torch

    def bias(rows: int, heads: int, grad: bool):
        size = (shape.batch, heads, rows, shape.seqlen_k)
        return (torch.randn(size, device="cuda", dtype=getattr(torch, shape.dtype)) * 0.5).requires_grad_(grad)

    def slopes():
        return torch.tensor([2.0 ** (-8 * (h + 1) / shape.q_heads) for h in range(shape.q_heads)], device="cuda")

    def sinks():
        return torch.randn(shape.q_heads, device="cuda", requires_grad=True)

    window = option_window(shape)
    return {
        "": lambda: {},
        "bias": lambda: {"attn_bias": bias(shape.seqlen_q, shape.q_heads, True)},
        "bias-row": lambda: {"attn_bias": bias(1, 1, False)},
        "window": lambda: {"window_size": window},
        "softcap": lambda: {"softcap": 30.0},
        "alibi": lambda: {"alibi_slopes": slopes()},
        "all": lambda: {
            "attn_bias": bias(1, 1, False),
            "window_size": window,
            "softcap": 30.0,
            "alibi_slopes": slopes(),
        },
        "sinks": lambda: {"sinks": sinks()},
        "window128": lambda: {"window_size": window},
        "window128-sinks": lambda: {"window_size": window, "sinks": sinks()},
    }[shape.option]()


def _sliced_kwargs(kwargs: dict, heads: int, rows: int) -> dict:
    """kwargs for batch 0, the first `heads` query heads and the last `rows` query rows."""
    sliced = dict(kwargs)
    if "attn_bias" in kwargs:
        bias = kwargs["attn_bias"].detach()[:1, :heads]
        sliced["attn_bias"] = bias[:, :, -rows:] if bias.shape[2] > 1 else bias
    if "alibi_slopes" in kwargs:
        sliced["alibi_slopes"] = kwargs["alibi_slopes"][:heads]
    if "sinks" in kwargs:
        sliced["sinks"] = kwargs["sinks"].detach()[:heads]
    return sliced


# ---- FLOPs and bytes ----------------------------------------------------------------------------


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int] | None = None) -> int:
    """Query-key pairs that are not masked. Causal masking is bottom-right aligned: query i sees
    keys j <= i + (Sk - Sq), so the count is Sq * (Sq + 1) / 2 when Sq = Sk, not half of Sq * Sk.
    A window (left, right) keeps keys i + Sk - Sq - left <= j <= i + Sk - Sq + right."""
    if not causal and window is None:
        return seqlen_q * seqlen_k
    offset = seqlen_k - seqlen_q
    left, right = window or (-1, -1)
    total = 0
    for i in range(seqlen_q):
        last = i + offset if causal else seqlen_k - 1
        if right >= 0:
            last = min(last, i + offset + right)
        first = max(i + offset - left, 0) if left >= 0 else 0
        total += max(min(last, seqlen_k - 1) - first + 1, 0)
    return total


def flops(mode: str, shape: Shape) -> float:
    """Matmul FLOPs: 4 * B * Hq * D per unmasked pair for the forward (QK^T and PV), scaled by mode."""
    pairs = visible_pairs(shape.seqlen_q, shape.seqlen_k, shape.causal, option_window(shape))
    return 4.0 * shape.batch * shape.q_heads * shape.head_dim * pairs * MODE_FLOP_FACTOR[mode]


def element_size(dtype: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}[dtype]


def min_bytes(mode: str, shape: Shape, with_lse: bool = True) -> int:
    """The fewest bytes a mode must move: each input read once and each output written once.

    Forward: read q, k, v; write out (and the fp32 LSE when training). Backward: read q, k, v,
    out, d_out and LSE; write dq, dk, dv; Delta (fp32 per query row) written once and read once.
    """
    size = element_size(shape.dtype)
    q_elems = shape.batch * shape.q_heads * shape.seqlen_q * shape.head_dim
    kv_elems = shape.batch * shape.kv_heads * shape.seqlen_k * shape.head_dim
    rows = shape.batch * shape.q_heads * shape.seqlen_q
    forward = size * (2 * q_elems + 2 * kv_elems) + (4 * rows if with_lse else 0)
    backward = size * (3 * q_elems + 2 * kv_elems) + 4 * rows + size * (q_elems + 2 * kv_elems) + 2 * 4 * rows
    return {"fwd": forward, "bwd": backward, "fwd+bwd": forward + backward}[mode]


# ---- providers ----------------------------------------------------------------------------------


class Unavailable(Exception):
    """A provider that cannot run this shape on this machine; reported, not raised."""


def make_inputs(shape: Shape, requires_grad: bool, seed: int = 0):
    import torch

    generator = torch.Generator(device="cuda").manual_seed(seed)
    dtype = getattr(torch, shape.dtype)

    def tensor(heads, seqlen):
        size = (shape.batch, heads, seqlen, shape.head_dim)
        t = torch.randn(size, device="cuda", dtype=dtype, generator=generator)
        return t.requires_grad_(requires_grad)

    return (
        tensor(shape.q_heads, shape.seqlen_q),
        tensor(shape.kv_heads, shape.seqlen_k),
        tensor(shape.kv_heads, shape.seqlen_k),
    )


def attention_fn(provider: str, shape: Shape, training: bool, kwargs=None):
    """A function (q, k, v) -> out for the provider, or Unavailable; kwargs: score modifiers."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if provider == "cutile":
        from tilegym import tile_fmha, tile_fmha_with_backward

        ours = tile_fmha_with_backward if training else tile_fmha
        return lambda q, k, v: ours(q, k, v, is_causal=shape.causal, **(kwargs or {}))
    if shape.option:
        raise Unavailable(f"compared only with our plain attention ({shape.option})")

    backend = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[provider]
    if provider == "math":
        scores_bytes = 4 * shape.batch * shape.q_heads * shape.seqlen_q * shape.seqlen_k
        if scores_bytes * (4 if training else 2) > MATH_MEMORY_LIMIT_BYTES:
            raise Unavailable("scores do not fit in memory")
    gqa = shape.q_heads != shape.kv_heads
    if shape.causal and shape.seqlen_q != shape.seqlen_k:
        raise Unavailable("SDPA's is_causal is top-left aligned; ours is bottom-right")

    def sdpa(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=gqa)

    return sdpa


def check_output(out, q, k, v, shape: Shape, rows: int = 256, kwargs=None) -> float:
    """Max error of the last `rows` query rows of batch 0 against the fp32 reference.

    With bottom-right causal masking, the last rows of a problem are the rows of the problem
    cut to those rows, so the reference needs only a slice of q.
    """
    import torch

    from tilegym.ops.attention.reference import attention_reference

    group = shape.q_heads // shape.kv_heads
    heads = min(shape.q_heads, 2 * group)
    q_slice = q.detach()[:1, :heads, -rows:]
    kv_heads = heads // group
    expected, _ = attention_reference(
        q_slice, k.detach()[:1, :kv_heads], v.detach()[:1, :kv_heads], is_causal=shape.causal,
        compute_dtype=torch.float32, **_sliced_kwargs(kwargs or {}, heads, q_slice.shape[2]),
    )  # fmt: skip
    return (out.detach()[:1, :heads, -rows:].float() - expected).abs().max().item()


# Larger than this against the fp32 reference marks a result as wrong in the table.
WRONG_ABOVE = {"bfloat16": 5e-2, "float16": 1e-2}


def median_ms(fn, warmup_ms: float = 10, rep_ms: float = 50, rounds: int = 2) -> float:
    """The smallest of `rounds` median times of fn in ms (triton's do_bench when available, else
    CUDA events): a transient slowdown of the GPU or host, which has halved single cells of a
    run, then spoils one round rather than the cell. Every provider is timed the same way."""
    return min(_one_median_ms(fn, warmup_ms, rep_ms) for _ in range(rounds))


def _one_median_ms(fn, warmup_ms: float, rep_ms: float) -> float:
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    except ImportError:
        pass
    import torch

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once_ms = max((time.perf_counter() - start) * 1e3, 1e-3)
    for _ in range(max(1, int(warmup_ms / once_ms))):
        fn()
    times = []
    for _ in range(max(5, int(rep_ms / once_ms))):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return sorted(times)[len(times) // 2]


# A cell whose calls take the host at least this share of the measured time per call is
# marked: do_bench's timing then includes the GPU waiting for launches whenever the host runs
# slower than usual (its time per call varies by half between moments on one machine).
HOST_BOUND_SHARE = 0.75
HOST_BOUND_MARK = "*"
HOST_BOUND_NOTE = (
    f"{HOST_BOUND_MARK}: issuing one call took the host at least {HOST_BOUND_SHARE:.0%} of the measured time per "
    "call, so the timing may include the GPU waiting for launches"
)
HOST_TIMED_CALLS = 10
# Host time is measured only for calls shorter than this: no provider's host path came near it.
HOST_TIMED_BELOW_MS = 4.0


def host_issue_ms(fn, rounds: int = 3) -> float:
    """Host time to issue one call of fn, in ms: HOST_TIMED_CALLS calls back to back without
    waiting for the GPU (launches queue), the smallest of `rounds`. When it nears the measured
    time per call, the measurement is of the launch path rather than of the kernels."""
    import torch

    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(HOST_TIMED_CALLS):
            fn()
        times.append((time.perf_counter() - start) / HOST_TIMED_CALLS * 1e3)
        torch.cuda.synchronize()
    return min(times)


# ---- one measurement ----------------------------------------------------------------------------


@dataclass
class Result:
    mode: str
    provider: str
    shape: Shape
    ms: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    max_error: float | None = None
    wrong: bool = False
    note: str = ""
    host_ms: float | None = None  # host time to issue one call (host_issue_ms)

    @property
    def host_bound(self) -> bool:
        """Whether the host's share of each call is large enough that the timing may include
        the GPU waiting for launches."""
        return bool(self.ms and self.host_ms and self.host_ms >= HOST_BOUND_SHARE * self.ms)

    def to_json(self) -> dict:
        data = asdict(self)
        data["series"] = self.shape.series
        return data

    @staticmethod
    def from_json(data: dict) -> "Result":
        data = {key: value for key, value in data.items() if key != "series"}
        data["shape"] = Shape(**data["shape"])
        return Result(**data)


def measure(mode: str, provider: str, shape: Shape, training_forward: bool = True) -> Result:
    """Check the provider's output once, then time the mode. Failures become notes.

    A training forward ("fwd" with training_forward) runs with inputs that require grad, so
    every provider also saves what its backward needs (LSE); an inference forward runs under
    no_grad.
    """
    import torch

    result = Result(mode, provider, shape)
    training = training_forward or mode != "fwd"
    try:
        q, k, v = make_inputs(shape, requires_grad=training)
        kwargs = option_kwargs(shape)
        fn = attention_fn(provider, shape, training, kwargs)
        inputs, d_out = (q, k, v), torch.randn_like(q)
        bias = kwargs.get("attn_bias")
        if bias is not None and bias.requires_grad and training:
            inputs = (q, k, v, bias)
        with torch.enable_grad() if training else torch.no_grad():
            out = fn(q, k, v)  # warm-up: compiles and tunes outside the timing
            result.max_error = check_output(out, q, k, v, shape, kwargs=kwargs)
            result.wrong = not result.max_error <= WRONG_ABOVE[shape.dtype]
            if training:  # the backward compiles in the background meanwhile: a timed forward would wait on it
                torch.autograd.grad(out, inputs, d_out, retain_graph=True)
            calls = {
                "fwd": lambda: fn(q, k, v),
                "fwd+bwd": lambda: torch.autograd.grad(fn(q, k, v), inputs, d_out),
                # retain_graph: the same forward graph is differentiated at every repetition.
                "bwd": lambda: torch.autograd.grad(out, inputs, d_out, retain_graph=True),
            }
            call = calls[mode]
            result.ms = median_ms(call)
            if result.ms < HOST_TIMED_BELOW_MS:
                result.host_ms = host_issue_ms(call)
        result.tflops = flops(mode, shape) / (result.ms * 1e-3) / 1e12
        result.gbps = min_bytes(mode, shape, with_lse=training) / (result.ms * 1e-3) / 1e9
    except Unavailable as reason:
        result.note = f"skipped: {reason}"
    except (RuntimeError, ValueError) as error:  # out of memory, or no kernel for this backend
        message = str(error).strip().splitlines()[0][:120] if str(error).strip() else ""
        result.note = f"unavailable: {type(error).__name__}: {message}"
    finally:
        torch.cuda.empty_cache()
    return result


# ---- running and tables -------------------------------------------------------------------------


def run_all(modes, providers, shape_list, training_forward: bool = True) -> list[Result]:
    results = []
    total = len(modes) * len(shape_list)
    done = 0
    for shape in shape_list:
        for mode in modes:
            done += 1
            row = []
            for provider in providers:
                result = measure(mode, provider, shape, training_forward)
                results.append(result)
                row.append(_cell(result))
            print(
                f"[{done}/{total}] {mode:8s} {shape.series:28s} B={shape.batch:<3d} S={shape.seqlen_q:<6d} "
                + "  ".join(f"{p}={c}" for p, c in zip(providers, row, strict=True)),
                flush=True,
            )
    return results


def _cell(result: Result) -> str:
    if result.tflops is None:
        return "n/a"
    return f"{result.tflops:.0f}{HOST_BOUND_MARK if result.host_bound else ''}{'(WRONG)' if result.wrong else ''}"


def table(results: list[Result]) -> str:
    """TFLOPS per row (mode, series, seqlen) and provider, with ours / cuDNN when both ran."""
    providers = [p for p in PROVIDERS if any(r.provider == p for r in results)]
    rows: dict[tuple, dict[str, Result]] = {}
    for result in results:
        rows.setdefault((result.mode, result.shape.series, result.shape.seqlen_q), {})[result.provider] = result
    header = f"{'mode':8s} {'series':28s} {'seqlen':>6s} " + " ".join(f"{p:>10s}" for p in providers)
    header += f" {'ours/cudnn':>10s}"
    lines = [header, "-" * len(header)]
    for (mode, series, seqlen), by_provider in rows.items():
        cells = " ".join(f"{_cell(by_provider[p]) if p in by_provider else '':>10s}" for p in providers)
        ours, cudnn = by_provider.get("cutile"), by_provider.get("cudnn")
        ratio = ""
        if ours and cudnn and ours.tflops and cudnn.tflops:
            ratio = f"{ours.tflops / cudnn.tflops:.2f}x"
        lines.append(f"{mode:8s} {series:28s} {seqlen:6d} {cells} {ratio:>10s}")
    notes: dict[tuple[str, str, str], list[int]] = {}
    for r in results:
        if r.note:
            notes.setdefault((r.provider, r.shape.series, r.note), []).append(r.shape.seqlen_q)
    if any(r.host_bound for r in results):
        lines += ["", HOST_BOUND_NOTE]
    if notes:
        lines += ["", "notes:"]
        for (provider, series, note), seqlens in sorted(notes.items()):
            lengths = ",".join(str(s) for s in sorted(set(seqlens)))
            lines.append(f"  {provider} {series} S={lengths}: {note}")
    return "\n".join(lines)


def markdown_summary(results: list[Result], seqlens=(1024, 4096, 16384), dtype: str = "bfloat16") -> str:
    """TFLOPS of ours, cuDNN and FlashAttention-2 per mode, and ours / cuDNN, as a Markdown table."""
    index = {(r.mode, r.shape.series, r.shape.seqlen_q, r.provider): r for r in results}
    modes = [m for m in MODE_FLOP_FACTOR if any(r.mode == m for r in results)]
    series_list = sorted({r.shape.series for r in results if r.shape.dtype == dtype and "gqa" not in r.shape.series})
    header = "| D, mask | S | " + " | ".join(f"{m} ours / cuDNN / FA2 (ratio)" for m in modes) + " |"
    lines = [header, "|" + " --- |" * (2 + len(modes))]
    marked = False
    for series in series_list:
        for seqlen in seqlens:
            cells = []
            for mode in modes:
                values = [index.get((mode, series, seqlen, p)) for p in ("cutile", "cudnn", "flash")]
                numbers = [_cell(v) if v else "n/a" for v in values]
                marked = marked or any(v and v.host_bound for v in values)
                ours, cudnn = values[0], values[1]
                ratio = (
                    f" ({ours.tflops / cudnn.tflops:.2f}x)" if ours and cudnn and ours.tflops and cudnn.tflops else ""
                )
                cells.append(" / ".join(numbers) + ratio)
            label = series.replace(f"-{dtype}", "").replace("-", ", ")
            lines.append(f"| {label} | {seqlen} | " + " | ".join(cells) + " |")
    if marked:
        lines += ["", HOST_BOUND_NOTE]
    return "\n".join(lines)


def option_cost_summary(results: list[Result]) -> str:
    """Markdown: per option, mode and sequence length, ours with the option in ms, and its
    time relative to our plain attention measured in the same run."""
    ours = {(r.mode, r.shape.head_dim, r.shape.causal, r.shape.seqlen_q, r.shape.option): r for r in results
            if r.provider == "cutile" and r.ms}  # fmt: skip
    modes = [m for m in MODE_FLOP_FACTOR if any(r.mode == m for r in results)]
    keys = sorted({(k[1], k[2], k[3]) for k in ours})
    options = [o for o in OPTIONS if any(k[4] == o for k in ours)]
    header = "| option | D, mask | S | " + " | ".join(f"{m} ms (x plain)" for m in modes) + " |"
    lines = [header, "|" + " --- |" * (3 + len(modes))]
    for option in options:
        for head_dim, causal, seqlen in keys:
            cells = []
            for mode in modes:
                plain, modified = (
                    ours.get((mode, head_dim, causal, seqlen, "")),
                    ours.get((mode, head_dim, causal, seqlen, option)),
                )
                if plain and modified:
                    cells.append(f"{modified.ms:.2f} ({modified.ms / plain.ms:.2f}x)")
                else:
                    cells.append("n/a")
            mask = "causal" if causal else "full"
            lines.append(f"| {option} | {head_dim}, {mask} | {seqlen} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- result files -------------------------------------------------------------------------------

# The script that writes each benchmark's results; its files are named <benchmark>.json.
BENCHMARK_SCRIPTS = {
    "attention_training": "bench_attention_backward.py",
    "attention_inference": "bench_attention.py",
    "attention_variants": "bench_attention_variants.py",
    "attention_programmable": "bench_programmable.py",
}


def save_json(results: list[Result], path: Path, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "results": [r.to_json() for r in results]}, indent=1))


def load_json(path: Path) -> tuple[list[Result], dict]:
    """(results, meta) of a file written by save_json."""
    document = json.loads(Path(path).read_text())
    return [Result.from_json(item) for item in document["results"]], document["meta"]


def read_results(path: Path) -> tuple[list[Result], dict]:
    """load_json, with any failure raised as a ValueError that names the file."""
    try:
        return load_json(path)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a readable results file ({type(error).__name__}: {error})") from None


def benchmark_of(meta: dict) -> str | None:
    """The benchmark that wrote a results file: meta["benchmark"], or for files written before
    that key, the script named in meta["command"]; None when the meta says neither."""
    if "benchmark" in meta:
        return meta["benchmark"]
    words = {Path(word).name for word in str(meta.get("command", "")).split()}
    return next((name for name, script in BENCHMARK_SCRIPTS.items() if script in words), None)


def load_results(paths, benchmark: str) -> tuple[list[Result], list[dict]]:
    """The results of one benchmark's files and each file's meta. A cell measured in several
    files keeps the last file's result, so a rerun of a few series can follow the full run.

    Raises ValueError naming the file when one cannot be read or another benchmark wrote it:
    its plots would be drawn under this benchmark's names.
    """
    cells: dict[tuple, Result] = {}
    metas = []
    for path in paths:
        results, meta = read_results(path)
        wrote = benchmark_of(meta)
        if wrote is None:
            raise ValueError(f"{path}: its meta names no benchmark (neither 'benchmark' nor a script in 'command')")
        if wrote != benchmark:
            script = f" by tests/benchmark/{BENCHMARK_SCRIPTS[wrote]}" if wrote in BENCHMARK_SCRIPTS else ""
            raise ValueError(
                f"{path} holds {wrote} results (written{script}), not {benchmark} results: replot it with "
                "its own script, or every file at once with tests/benchmark/replot.py"
            )
        for result in results:
            cells[result.mode, result.provider, result.shape] = result
        metas.append(meta)
    return list(cells.values()), metas


def replot_results(p: argparse.ArgumentParser, paths, benchmark: str) -> tuple[list[Result], list[dict]]:
    """load_results, with a refused file reported as a usage error (exit status 2)."""
    try:
        return load_results(paths, benchmark)
    except ValueError as error:
        p.error(str(error))


# ---- figures ------------------------------------------------------------------------------------

FIGURE_DPI = 90  # keeps the 117 committed figures near 6 MB
PROVIDER_COLORS = {provider: f"C{index}" for index, provider in enumerate(PROVIDERS)}  # alike in every figure
OPTION_LABELS = {
    "bias": "bias [B, H, S, S] with dBias",
    "bias-row": "key-padding bias [B, 1, 1, S]",
    "window": f"sliding window {WINDOW}",
    "softcap": "softcap 30",
    "alibi": "ALiBi",
    "all": "padding bias, window, softcap, ALiBi",
    "sinks": "learnable sinks with dSink",
    "window128": f"sliding window {SHORT_WINDOW}",
    "window128-sinks": f"sliding window {SHORT_WINDOW} and sinks",
}
_MODES = tuple(MODE_FLOP_FACTOR)


@dataclass(frozen=True)
class Figure:
    path: Path
    title: str
    group: str  # "overview", or the mode it shows


def _figure(out_dir: Path, words: tuple[str, ...], group: str) -> Figure:
    """A figure whose file name is its title: the title joins the words with " · ", the file
    name with "-" (spaces and "+" become "_"), so one can be read off the other."""
    stem = "-".join(word.replace(" ", "_").replace("+", "_") for word in words)
    return Figure(out_dir / f"{stem}.png", " · ".join(words), group)


def _series_key(shape: Shape) -> tuple:
    """Series in reading order: D, mask, GQA ratio, dtype, score modifier."""
    option = OPTIONS.index(shape.option) + 1 if shape.option else 0
    return shape.head_dim, shape.causal, shape.q_heads // shape.kv_heads, shape.dtype, option


def environment(metas) -> str:
    """The GPU and versions that produced the results, as far as their files recorded them."""
    lines = []
    for meta in metas:
        words = [meta.get("gpu", "GPU not recorded")]
        versions = (("torch", "PyTorch"), ("cuda_tile", "cuda-tile"))
        words += [f"{name} {meta[key]}" for key, name in versions if key in meta]
        if ", ".join(words) not in lines:
            lines.append(", ".join(words))
    return "; ".join(lines) or "GPU and versions not recorded"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(figure, drawn: Figure, footer: str) -> Figure:
    """Title on top, the GPU and versions (and notes) in small print below, then the file."""
    figure.suptitle(drawn.title, fontsize=10)
    figure.supxlabel(footer, fontsize=7, color="0.35")
    drawn.path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(drawn.path, dpi=FIGURE_DPI)
    _pyplot().close(figure)
    return drawn


def _seqlen_axis(axis, seqlens) -> None:
    """A log-2 axis ticked at the measured lengths, written out (1024, not 2^10)."""
    axis.set_xscale("log", base=2)
    axis.set_xticks(seqlens, [str(seqlen) for seqlen in seqlens])
    axis.minorticks_off()
    axis.set_xlabel(f"sequence length (batch x seqlen = {TOKENS} tokens)")


def plot(results: list[Result], out_dir: Path, prefix: str, metas=()) -> list[Figure]:
    """One TFLOPS and one GBps figure per (mode, series), a line per provider, against seqlen."""
    plt = _pyplot()
    footer = environment(metas)
    groups: dict[tuple, list[Result]] = {}
    for result in results:
        key = (_MODES.index(result.mode), _series_key(result.shape), result.mode, result.shape.series)
        groups.setdefault(key, []).append(result)
    drawn = []
    for (_, _, mode, series), group in sorted(groups.items()):
        seqlens = sorted({r.shape.seqlen_q for r in group})
        for metric, label in (("tflops", "TFLOPS"), ("gbps", "GBps")):
            figure, axis = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
            for provider in PROVIDERS:
                points = sorted(
                    (r.shape.seqlen_q, getattr(r, metric))
                    for r in group
                    if r.provider == provider and getattr(r, metric)
                )
                if points:
                    xs, ys = zip(*points, strict=True)
                    axis.plot(xs, ys, marker="o", color=PROVIDER_COLORS[provider], label=PROVIDER_LABELS[provider])
            _seqlen_axis(axis, seqlens)
            axis.set_ylim(bottom=0)
            axis.set_ylabel(label)
            axis.grid(True, alpha=0.3)
            if axis.lines:
                axis.legend(fontsize=8)
            words = (prefix.replace("_", " "), mode, series, label)
            drawn.append(_save(figure, _figure(out_dir, words, mode), footer))
    return drawn


def plot_overview(results: list[Result], out_dir: Path, prefix: str, metas=()) -> list[Figure]:
    """A heatmap of ours / cuDNN TFLOPS per (mode, D, mask) row and sequence length, a panel per
    dtype and GQA ratio; no figure when no cell has both ours and cuDNN."""
    by_cell = {(r.mode, r.provider, r.shape): r for r in results}
    cells = {}
    for ours in results:
        cudnn = by_cell.get((ours.mode, "cudnn", ours.shape))
        if ours.provider == "cutile" and ours.tflops and cudnn and cudnn.tflops:
            shape = ours.shape
            panel = (shape.q_heads // shape.kv_heads, shape.dtype)
            row = (_MODES.index(ours.mode), shape.head_dim, shape.causal)
            cells[panel, row, shape.seqlen_q] = (ours.tflops / cudnn.tflops, ours.host_bound or cudnn.host_bound)
    if not cells:
        return []
    notes = ["ours / cuDNN TFLOPS, above 1 where ours is faster"]
    if any(marked for _, marked in cells.values()):
        notes.append(HOST_BOUND_NOTE)
    return [
        _heatmap(
            cells,
            panel_label=lambda panel: panel[1] + (f", GQA {panel[0]}:1" if panel[0] > 1 else ""),
            row_label=lambda row: f"{_MODES[row[0]]} d{row[1]} {'causal' if row[2] else 'full'}",
            drawn=_figure(out_dir, (prefix.replace("_", " "), "overview", "ours vs cuDNN"), "overview"),
            footer="\n".join([environment(metas), *notes]),
            colorbar_label="ours / cuDNN",
            higher_is_better=True,
        )
    ]


def _plain(shape: Shape) -> Shape:
    return replace(shape, option="")


def plot_option_overview(results: list[Result], out_dir: Path, prefix: str, metas=()) -> list[Figure]:
    """A heatmap of our time with each score modifier / our plain attention's time of the same
    shape and run, per (modifier, D, mask) row and sequence length, a panel per mode."""
    ours = {(r.mode, r.shape): r for r in results if r.provider == "cutile" and r.ms}
    cells = {}
    for (mode, shape), modified in ours.items():
        plain = ours.get((mode, _plain(shape)))
        if shape.option and plain:
            row = (OPTIONS.index(shape.option), shape.head_dim, shape.causal)
            cells[_MODES.index(mode), row, shape.seqlen_q] = (modified.ms / plain.ms, False)
    if not cells:
        return []
    return [
        _heatmap(
            cells,
            panel_label=lambda panel: _MODES[panel],
            row_label=lambda row: f"{OPTIONS[row[0]]}, d{row[1]} {'causal' if row[2] else 'full'}",
            drawn=_figure(out_dir, (prefix.replace("_", " "), "overview", "time vs plain"), "overview"),
            footer=environment(metas) + "\ntime with the modifier / time of plain attention, same shape and run: "
            "above 1 where the modifier costs time",
            colorbar_label="time / plain time",
            higher_is_better=False,
        )
    ]


def _heatmap(
    cells: dict, panel_label, row_label, drawn: Figure, footer: str, colorbar_label: str, higher_is_better: bool
) -> Figure:
    """cells: {(panel, row, seqlen): (ratio, marked)}, panels and rows in sorted key order. The
    colour scale is logarithmic and centred on 1, so 0.8x and 1.25x are equally far from white."""
    import numpy as np
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    panels = sorted({key[0] for key in cells})
    rows = sorted({key[1] for key in cells})
    seqlens = sorted({key[2] for key in cells})
    # At least 1.25: differences of a few percent stay pale.
    spread = max(1.25, *(max(value, 1 / value) for value, _ in cells.values()))
    norm = LogNorm(1 / spread, spread)
    size = (2.2 + len(panels) * (0.5 * len(seqlens) + 0.3), 1.9 + 0.27 * len(rows))
    figure, axes = plt.subplots(1, len(panels), figsize=size, sharey=True, squeeze=False, layout="constrained")
    for axis, panel in zip(axes[0], panels, strict=True):
        grid = np.full((len(rows), len(seqlens)), np.nan)
        for i, row in enumerate(rows):
            for j, seqlen in enumerate(seqlens):
                if (panel, row, seqlen) not in cells:
                    axis.text(j, i, "n/a", ha="center", va="center", fontsize=7, color="0.4")
                    continue
                value, marked = cells[panel, row, seqlen]
                grid[i, j] = value
                dark = abs(np.log(value)) > 0.6 * np.log(spread)
                text = f"{value:.2f}{HOST_BOUND_MARK if marked else ''}"
                axis.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if dark else "black")
        image = axis.imshow(np.ma.masked_invalid(grid), cmap="RdBu" if higher_is_better else "RdBu_r", norm=norm,
                            aspect="auto")  # fmt: skip
        axis.set_facecolor("0.85")  # cells without a measurement
        # A line where the first field of the row key changes (a mode, a modifier), if rows share it.
        starts = [i for i in range(1, len(rows)) if rows[i][0] != rows[i - 1][0]]
        if len(starts) < len(rows) - 1:
            for start in starts:
                axis.axhline(start - 0.5, color="black", linewidth=0.8)
        axis.set_xticks(range(len(seqlens)), [str(seqlen) for seqlen in seqlens], fontsize=7)
        axis.set_yticks(range(len(rows)), [row_label(row) for row in rows], fontsize=8)
        axis.tick_params(length=0)
        axis.set_xlabel("sequence length", fontsize=8)
        axis.set_title(panel_label(panel), fontsize=9)
    # Ticks at 1 and at round ratios either side, at least a fifth of the scale apart.
    above = [1.0]
    for tick in (1.1, 1.25, 1.5, 2, 3, 4, 8):
        if tick <= spread and np.log(tick / above[-1]) >= np.log(spread) / 5:
            above.append(tick)
    ticks = sorted({*above, *(1 / t for t in above)})
    colorbar = figure.colorbar(image, ax=axes[0].tolist(), shrink=0.9, pad=0.02, label=colorbar_label)
    colorbar.set_ticks(ticks, labels=[f"{t:.2g}" for t in ticks])
    colorbar.minorticks_off()
    return _save(figure, drawn, footer)


def plot_options(results: list[Result], out_dir: Path, prefix: str, metas=()) -> list[Figure]:
    """Per mode, series and score modifier: our TFLOPS with the modifier beside our plain
    attention of the same shapes and run, y from zero, each point marked with its time
    relative to plain. That ratio is the modifier's cost: a window's FLOPs count only the pairs
    it keeps, so its TFLOPS may fall while its time falls further."""
    plt = _pyplot()
    ours = {(r.mode, r.shape): r for r in results if r.provider == "cutile" and r.ms}
    groups: dict[tuple, list[Result]] = {}
    for result in results:
        if result.provider == "cutile" and result.shape.option:
            key = (_MODES.index(result.mode), _series_key(result.shape), result.mode)
            groups.setdefault(key, []).append(result)
    drawn = []
    for (_, _, mode), group in sorted(groups.items()):
        group.sort(key=lambda r: r.shape.seqlen_q)
        option, series = group[0].shape.option, _plain(group[0].shape).series
        seqlens = [r.shape.seqlen_q for r in group]
        measured = [r for r in group if r.ms]
        plains = {r.shape.seqlen_q: ours.get((mode, _plain(r.shape))) for r in group}
        figure, axis = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
        baseline = [(seqlen, plain.tflops) for seqlen, plain in plains.items() if plain]
        if baseline:
            xs, ys = zip(*baseline, strict=True)
            axis.plot(xs, ys, marker="o", linestyle="--", color="0.45", label="plain attention, same run")
        else:
            axis.text(0.5, 0.5, "no plain baseline in the data", transform=axis.transAxes, ha="center")
        if measured:
            axis.plot([r.shape.seqlen_q for r in measured], [r.tflops for r in measured], marker="o", color="C0",
                      label=OPTION_LABELS.get(option, option))  # fmt: skip
        for result in measured:
            plain = plains[result.shape.seqlen_q]
            if plain:
                below = result.tflops < plain.tflops  # the label away from the baseline
                axis.annotate(
                    f"{result.ms / plain.ms:.2f}x time", (result.shape.seqlen_q, result.tflops),
                    textcoords="offset points", xytext=(0, -13 if below else 7), ha="center", fontsize=8, color="C0",
                )  # fmt: skip
        _seqlen_axis(axis, seqlens)
        axis.margins(x=0.08)
        axis.set_ylim(0, 1.15 * max((y for line in axis.lines for y in line.get_ydata()), default=1))
        axis.set_ylabel("TFLOPS (FLOPs of the pairs not masked)")
        axis.grid(True, alpha=0.3)
        if axis.lines:
            axis.legend(fontsize=8)
        notes = [f"{option} at S={r.shape.seqlen_q}: {r.note}" for r in group if not r.ms]
        words = (prefix.replace("_", " "), mode, series, f"{option} vs plain", "TFLOPS")
        drawn.append(_save(figure, _figure(out_dir, words, mode), "\n".join([environment(metas), *notes])))
    return drawn


def figures(benchmark: str, results: list[Result], out_dir: Path, metas=()) -> list[Figure]:
    """Every figure of one benchmark's results, its overview first."""
    if benchmark == "attention_variants":
        overview, lines = plot_option_overview, plot_options
    else:
        overview, lines = plot_overview, plot
    return overview(results, out_dir, benchmark, metas) + lines(results, out_dir, benchmark, metas)


# ---- command lines ------------------------------------------------------------------------------


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help with each option's default, and the description as written, so that its example
    commands stay one per line."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        # An option without a default says in its help what happens without it.
        if default is None or default is argparse.SUPPRESS or "%(default)" in text:
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text
        if isinstance(default, list | tuple):
            default = " ".join(str(value) for value in default)
        return f"{text} (default: {str(default).replace('%', '%%')})"


def parser(description: str, modes: tuple[str, ...], prefix: str, first_call: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    p.add_argument("--modes", nargs="+", choices=modes, default=list(modes), help="what to time")
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128], help=f"head dims D; H = {HIDDEN} / D")
    p.add_argument("--causal", choices=("both", "true", "false"), default="both", help="causal, full or both")
    p.add_argument("--dtypes", nargs="+", choices=("bfloat16", "float16"), default=["bfloat16", "float16"],
                   help="input dtypes")  # fmt: skip
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS),
                   help="ours (cutile) and PyTorch SDPA pinned to each backend")  # fmt: skip
    p.add_argument("--seqlens", nargs="+", type=int, default=list(SEQLENS),
                   help=f"sequence lengths; batch = {TOKENS} // seqlen")  # fmt: skip
    p.add_argument("--no-gqa", action="store_true", help="leave out the GQA 8:1 series")
    p.add_argument("--quick", action="store_true", help="a small subset: bf16, S in {1024, 4096}, no GQA")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="directory for the JSON file and the figures")
    p.add_argument("--replot", nargs="+", type=Path, metavar="JSON",
                   help=f"measure nothing: redraw the figures and print the tables of earlier {prefix}.json "
                   "files (several are merged)")  # fmt: skip
    if first_call:
        p.add_argument("--no-first-call", action="store_true", help="leave out the first-step times")
        p.add_argument("--goal", action="store_true",
                       help="the goal's cells instead of the series: D in 64 96 128 256, causal and full, S in 1024 "
                       "4096 16384, bf16, and GQA 8:1 and a (1024, 0) window at D=128 S=16384; prints each "
                       "against cuDNN and FlashAttention-4's figures")  # fmt: skip
    return p


def causal_options(choice: str) -> list[bool]:
    return {"both": [False, True], "true": [True], "false": [False]}[choice]


def main(description: str, modes: tuple[str, ...], prefix: str, training_forward: bool, first_call=False) -> None:
    """first_call: also time the first training step in new processes (tests/benchmark/first_call.py)."""
    p = parser(description, modes, prefix, first_call)
    args = p.parse_args()
    if args.replot:
        results, metas = replot_results(p, args.replot, prefix)
        drawn = figures(prefix, results, args.out, metas)
        print(table(results))
        print()
        print(markdown_summary(results))
        if any("--goal" in meta.get("command", "") for meta in metas):
            print()
            print(goal_summary(results))
        for meta in metas:
            _print_first_call(meta)
        print(f"\n{len(drawn)} figures in {args.out}")
        return
    meta = {"benchmark": prefix, **_environment()}
    if first_call and not args.no_first_call:
        meta["first_call"] = first_call_times.measure()
    seqlens, dtypes, gqa = args.seqlens, args.dtypes, not args.no_gqa
    if args.quick:
        seqlens, dtypes, gqa = list(QUICK_SEQLENS), ["bfloat16"], False
    goal = getattr(args, "goal", False)
    shape_list = goal_shapes() if goal else shapes(args.head_dims, causal_options(args.causal), dtypes, seqlens, gqa)
    started = time.perf_counter()
    results = run_all(args.modes, args.providers, shape_list, training_forward)
    elapsed = time.perf_counter() - started
    print()
    print(table(results))
    if goal:
        print()
        print(goal_summary(results))
    _print_first_call(meta)
    meta.update({"command": " ".join(_argv()), "wall_seconds": round(elapsed, 1)})
    save_json(results, args.out / f"{prefix}.json", meta)
    drawn = figures(prefix, results, args.out, [meta])
    print(f"\n{len(results)} measurements in {elapsed:.0f} s; {len(drawn)} figures and {prefix}.json in {args.out}")


def _print_first_call(meta: dict) -> None:
    if "first_call" in meta:
        print(f"\n{first_call_times.summary(meta['first_call'])}")


def _argv() -> list[str]:
    import sys

    return ["python", *sys.argv]


def _environment() -> dict:
    import torch

    meta = {"torch": torch.__version__}
    try:
        import cuda.tile as ct

        meta["cuda_tile"] = getattr(ct, "__version__", "unknown")
    except ImportError:
        pass
    if torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name()
    return meta
