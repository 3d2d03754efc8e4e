"""Shared pieces of the attention benchmarks: shapes, providers, FLOP and byte counts,
correctness check, timing, result files and plots.

Shapes follow the FlashAttention papers: batch x seqlen = 16384 tokens and hidden 2048,
so H = 2048 / D. Sequence lengths run from 512 to 16384.
"""

import argparse
import json
import time
from dataclasses import asdict, dataclass
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


# ---- score modifiers ------------------------------------------------------------------------------

# Each option's keyword arguments, as a model would use them: a trainable full bias, a key
# padding mask (one row per batch, no grad), a 1024-key sliding window, Gemma 2's softcap 30,
# ALiBi with the usual geometric slopes, and all of them together.
OPTIONS = ("bias", "bias-row", "window", "softcap", "alibi", "all")
WINDOW = 1024


def option_kwargs(shape: Shape) -> dict:
    """The score modifiers of shape.option, on the GPU; {} for plain attention."""
    import torch

    def bias(rows: int, heads: int, grad: bool):
        size = (shape.batch, heads, rows, shape.seqlen_k)
        return (torch.randn(size, device="cuda", dtype=getattr(torch, shape.dtype)) * 0.5).requires_grad_(grad)

    def slopes():
        return torch.tensor([2.0 ** (-8 * (h + 1) / shape.q_heads) for h in range(shape.q_heads)], device="cuda")

    window = (WINDOW, 0 if shape.causal else WINDOW)
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
    }[shape.option]()


def _sliced_kwargs(kwargs: dict, heads: int, rows: int) -> dict:
    """kwargs for batch 0, the first `heads` query heads and the last `rows` query rows."""
    sliced = dict(kwargs)
    if "attn_bias" in kwargs:
        bias = kwargs["attn_bias"].detach()[:1, :heads]
        sliced["attn_bias"] = bias[:, :, -rows:] if bias.shape[2] > 1 else bias
    if "alibi_slopes" in kwargs:
        sliced["alibi_slopes"] = kwargs["alibi_slopes"][:heads]
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
    window = None
    if shape.option in ("window", "all"):
        window = (WINDOW, 0 if shape.causal else WINDOW)
    pairs = visible_pairs(shape.seqlen_q, shape.seqlen_k, shape.causal, window)
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


# ---- running, tables, files, plots --------------------------------------------------------------


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


def save_json(results: list[Result], path: Path, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "results": [r.to_json() for r in results]}, indent=1))


def load_json(path: Path) -> tuple[list[Result], dict]:
    """(results, meta) of a file written by save_json."""
    document = json.loads(Path(path).read_text())
    return [Result.from_json(item) for item in document["results"]], document["meta"]


def plot(results: list[Result], out_dir: Path, prefix: str) -> list[Path]:
    """One TFLOPS and one GBps figure per (mode, series), lines per provider, against seqlen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    groups: dict[tuple[str, str], list[Result]] = {}
    for result in results:
        groups.setdefault((result.mode, result.shape.series), []).append(result)
    for (mode, series), group in sorted(groups.items()):
        for metric, label in (("tflops", "TFLOPS"), ("gbps", "GBps")):
            figure, axis = plt.subplots(figsize=(6, 4))
            for provider in PROVIDERS:
                points = sorted(
                    (r.shape.seqlen_q, getattr(r, metric))
                    for r in group
                    if r.provider == provider and getattr(r, metric)
                )
                if points:
                    xs, ys = zip(*points, strict=True)
                    axis.plot(xs, ys, marker="o", label=PROVIDER_LABELS[provider])
            axis.set_xscale("log", base=2)
            axis.set_xlabel("sequence length (batch x seqlen = 16384 tokens)")
            axis.set_ylabel(label)
            axis.set_title(f"attention {mode}, {series}")
            axis.grid(True, alpha=0.3)
            axis.legend(fontsize=8)
            figure.tight_layout()
            path = out_dir / f"{prefix}-{mode.replace('+', '_')}-{series}-{label}.png"
            figure.savefig(path, dpi=100)
            plt.close(figure)
            written.append(path)
    return written


def parser(description: str, modes: tuple[str, ...]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--modes", nargs="+", choices=modes, default=list(modes))
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    p.add_argument("--causal", choices=("both", "true", "false"), default="both")
    p.add_argument("--dtypes", nargs="+", choices=("bfloat16", "float16"), default=["bfloat16", "float16"])
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--seqlens", nargs="+", type=int, default=list(SEQLENS))
    p.add_argument("--no-gqa", action="store_true", help="leave out the GQA 8:1 series")
    p.add_argument("--quick", action="store_true", help="a small subset: bf16, S in {1024, 4096}, no GQA")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="directory for JSON and plots")
    p.add_argument("--replot", type=Path, help="only plot (and summarize) the results of an earlier JSON file")
    p.add_argument("--no-first-call", action="store_true", help="leave out the first-step times (training only)")
    return p


def causal_options(choice: str) -> list[bool]:
    return {"both": [False, True], "true": [True], "false": [False]}[choice]


def main(description: str, modes: tuple[str, ...], prefix: str, training_forward: bool, first_call=False) -> None:
    """first_call: also time the first training step in new processes (tests/benchmark/first_call.py)."""
    args = parser(description, modes).parse_args()
    if args.replot:
        results, meta = load_json(args.replot)
        plots = plot(results, args.out, prefix)
        print(table(results))
        print()
        print(markdown_summary(results))
        _print_first_call(meta)
        print(f"\n{len(plots)} plots in {args.out}")
        return
    meta = _environment()
    if first_call and not args.no_first_call:
        meta["first_call"] = first_call_times.measure()
    seqlens, dtypes, gqa = args.seqlens, args.dtypes, not args.no_gqa
    if args.quick:
        seqlens, dtypes, gqa = list(QUICK_SEQLENS), ["bfloat16"], False
    shape_list = shapes(args.head_dims, causal_options(args.causal), dtypes, seqlens, gqa)
    started = time.perf_counter()
    results = run_all(args.modes, args.providers, shape_list, training_forward)
    elapsed = time.perf_counter() - started
    print()
    print(table(results))
    _print_first_call(meta)
    meta.update({"command": " ".join(_argv()), "wall_seconds": round(elapsed, 1)})
    save_json(results, args.out / f"{prefix}.json", meta)
    plots = plot(results, args.out, prefix)
    print(f"\n{len(results)} measurements in {elapsed:.0f} s; {len(plots)} plots and {prefix}.json in {args.out}")


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
