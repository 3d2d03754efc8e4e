"""Every attention kernel under compute-sanitizer's four tools, one line per case and tool.

    python -m tests.ops.sanitize                 # all cases, all tools (GPU, a few minutes)
    python -m tests.ops.sanitize --tools racecheck --cases forward_bf16
    python -m tests.ops.sanitize --run CASE      # one case without the sanitizer (what each tool runs)

Each case runs a few calls of the public API on a small odd shape (B=1, H=2, S=130) in a process
of its own under `compute-sanitizer --tool T`. The kernels are compiled first, outside the
sanitizer, into a shared kernel cache, so the sanitized processes only launch. A line reads
`case  tool  N errors` (racecheck: hazards) with the kernels the case launched; the exit code is
non-zero if any count is, or a run failed. docs/sanitizer.md explains the reports that remain.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
_SHAPE = dict(batch=1, heads=2, seqlen=130, head_dim=128)


def _inputs(dtype, requires_grad=True, kv_heads=None, head_dim=None):
    import torch

    b, h, s, d = _SHAPE["batch"], _SHAPE["heads"], _SHAPE["seqlen"], head_dim or _SHAPE["head_dim"]
    shapes = [(b, h, s, d), (b, kv_heads or h, s, d), (b, kv_heads or h, s, d)]
    return [torch.randn(shape, dtype=dtype, device="cuda").requires_grad_(requires_grad) for shape in shapes]


def _training_step(dtype, backward="two-kernel", **mods):
    import torch

    from tilegym import tile_fmha_with_backward

    os.environ["TILEGYM_BACKWARD"] = backward
    q, k, v = _inputs(dtype)
    out = tile_fmha_with_backward(q, k, v, **mods)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()


def _inference(dtype, with_lse):
    import torch

    from tilegym import fmha_forward_with_lse, tile_fmha

    q, k, v = _inputs(dtype, requires_grad=False)
    for causal in (False, True):
        result = (fmha_forward_with_lse if with_lse else tile_fmha)(q, k, v, is_causal=causal)
        for t in result if with_lse else (result,):
            assert torch.isfinite(t).all()  # read back, so initcheck sees whether every element was written


def _bias_step(dtype):
    import torch

    s = _SHAPE["seqlen"]
    bias = torch.randn((_SHAPE["heads"], s, s), dtype=torch.float32, device="cuda", requires_grad=True)
    _training_step(dtype, attn_bias=bias, is_causal=False)


def _alibi_step(dtype):
    import torch

    slopes = torch.rand(_SHAPE["heads"], dtype=torch.float32, device="cuda")
    _training_step(dtype, alibi_slopes=slopes)


def _relative_in_documents_step(dtype):
    """A training step with a learnable relative-position table (aux_grad's atomic adds) and a
    document mask (the block mask's sorting kernel and tile lists)."""
    import torch

    from tilegym.ops.attention import score_functions

    s = _SHAPE["seqlen"]
    table = torch.randn(_SHAPE["heads"], 33, device="cuda", requires_grad=True)
    ids = (torch.arange(s, device="cuda", dtype=torch.int32) * 3 // s)[None]  # 3 documents
    _training_step(dtype, **score_functions.relative_position_bias(table, 16), **score_functions.document_mask(ids))


def _packed_step(dtype, cu_seqlens: list[int], max_seqlen: int, total: int):
    """A training step of a packed batch (tile_fmha_varlen) with these cumulative lengths, which
    may be inconsistent (decreasing, past the end, longer than max_seqlen): the kernels clamp
    them, and memcheck shows whether anything is read or written outside the tensors."""
    import torch

    from tilegym import tile_fmha_varlen

    heads, head_dim = _SHAPE["heads"], _SHAPE["head_dim"]
    q, k, v = (torch.randn(total, heads, head_dim, dtype=dtype, device="cuda", requires_grad=True) for _ in range(3))
    cu = torch.tensor(cu_seqlens, dtype=torch.int32, device="cuda")
    for causal in (False, True):
        out, lse = tile_fmha_varlen(q, k, v, cu, cu, max_seqlen, max_seqlen, is_causal=causal, return_lse=True)
        torch.autograd.backward((out, lse), (torch.randn_like(out), torch.randn_like(lse)))
    torch.cuda.synchronize()


CASES = {
    "forward_bf16": lambda: _inference(_bf16(), with_lse=False),
    "forward_fp32": lambda: _inference(_fp32(), with_lse=False),
    "forward_lse_bf16": lambda: _inference(_bf16(), with_lse=True),
    "backward_two_kernel_bf16": lambda: _training_step(_bf16(), "two-kernel", is_causal=False),
    "backward_two_kernel_fp32": lambda: _training_step(_fp32(), "two-kernel", is_causal=True),
    "backward_fused_bf16": lambda: _training_step(_bf16(), "fused", is_causal=False),
    "backward_fused_causal_bf16": lambda: _training_step(_bf16(), "fused", is_causal=True),
    "bias_grad_bf16": lambda: _bias_step(_bf16()),
    "window_bf16": lambda: _training_step(_bf16(), window_size=(17, 3), is_causal=False),
    "softcap_bf16": lambda: _training_step(_bf16(), softcap=20.0),
    "alibi_bf16": lambda: _alibi_step(_bf16()),
    "score_and_mask_functions_bf16": lambda: _relative_in_documents_step(_bf16()),
    "varlen_bf16": lambda: _packed_step(_bf16(), [0, 0, 1, 131, 198, 198], 130, 205),
    "varlen_inconsistent_bf16": lambda: _packed_step(_bf16(), [3, 150, 40, 400, -7, 2**31 - 1], 64, 205),
    # The smallest kernels that show how racecheck reads cuTile's loads (sanitizer_repro.py).
    "repro_row_slice": lambda: _repro("row_slice"),
    "repro_tile": lambda: _repro("tile"),
    "repro_matmul": lambda: _repro("matmul"),
    "repro_row_stat_columns_flat": lambda: _repro("row_stat_columns_flat"),
    "repro_row_stat_columns_2d": lambda: _repro("row_stat_columns_2d"),
}


# (tool, case) pairs the tool cannot check, with why (docs/sanitizer.md): they are not run.
_UNCHECKABLE = {
    ("memcheck", case): "bulk-copy descriptors of slices go to driver scratch memcheck does not track"
    for case in ("varlen_bf16", "varlen_inconsistent_bf16")
}


def _repro(name: str) -> None:
    from tests.ops import sanitizer_repro

    sanitizer_repro.run(name)


def _bf16():
    import torch

    return torch.bfloat16


def _fp32():
    import torch

    return torch.float32


def _run_case(name: str) -> None:
    """Runs one case and prints the kernels it launched (from cuTile's launch calls)."""
    import cuda.tile as ct

    launched = []
    original = ct.launch

    def recording_launch(stream, grid, kernel, args):
        launched.append(kernel._pyfunc.__name__)
        return original(stream, grid, kernel, args)

    ct.launch = recording_launch
    try:
        CASES[name]()
    finally:
        ct.launch = original
    print("kernels:", " ".join(sorted(set(launched))))


_SUMMARY = re.compile(r"(?:ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error)")
# racecheck shows one report per pair of instructions, with the count of hazards behind it.
_HAZARDS = re.compile(r"\[(\d+) hazards?\]")
_SKIPPED = re.compile(r"(\d+) errors? were skipped")


def _sanitized(tool: str, case: str, environment: dict, log_dir: str) -> tuple[str, str, int | None, str]:
    """(case, tool, count or None if the run failed, kernels) of one sanitized run; its log kept."""
    # initcheck: every report, one line each, to tell reads inside our kernels from the rest.
    limits = ["--print-limit", "0", "--show-backtrace", "no"] if tool == "initcheck" else ["--print-limit", "20"]
    command = [_sanitizer(), "--tool", tool, *limits, sys.executable, "-m", __spec__.name]
    result = subprocess.run([*command, "--run", case], capture_output=True, text=True, env=environment)
    text = result.stdout + result.stderr
    with open(os.path.join(log_dir, f"{case}.{tool}.log"), "w") as log:
        log.write(text)
    counts = [int(a or b) for a, b in _SUMMARY.findall(text)]
    if counts:  # reports the device's buffer could not hold are counted apart
        counts[-1] += sum(int(n) for n in _SKIPPED.findall(text))
    if tool == "racecheck" and counts:
        counts = [max(counts[-1], sum(int(n) for n in _HAZARDS.findall(text)))]
    kernels = next((line.removeprefix("kernels: ") for line in text.splitlines() if line.startswith("kernels: ")), "")
    failed = result.returncode != 0 and not counts
    count = None if failed or not counts else counts[-1]
    if tool == "initcheck" and count:
        # initcheck does not see bulk tensor stores (docs/sanitizer.md): the reads it reports are
        # of outputs our kernels wrote, by whatever reads them next. Those inside ours are apart.
        printed = text.count("Uninitialized __global__ memory read") + text.count("Host API memory access error")
        kernels = f"({_reports_in(text, kernels.split())} of {printed} printed in the tile kernels) {kernels}"
    return case, tool, count, kernels


def _reports_in(text: str, kernels: list[str]) -> int:
    """Reports whose faulting function is one of these kernels (a report's `at` line)."""
    places = [line for line in text.splitlines() if re.match(r"=========\s+at ", line)]
    return sum(1 for place in places if any(kernel in place for kernel in kernels))


def _sanitizer() -> str:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        candidate = os.path.join(root, "bin", "compute-sanitizer")
        if os.path.isfile(candidate):
            return candidate
    raise SystemExit("compute-sanitizer not found: install the CUDA toolkit or put it on PATH")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tools", nargs="+", default=list(TOOLS), choices=TOOLS, help="tools to run (default: all)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), help="cases (default: all)")
    parser.add_argument("--run", choices=list(CASES), help="run one case here, without the sanitizer")
    parser.add_argument("--logs", default=None, help="folder for the full reports (default: a new temp folder)")
    parser.add_argument("--jobs", type=int, default=4, help="sanitized processes at a time (default: 4)")
    options = parser.parse_args()
    if options.run:
        _run_case(options.run)
        return 0
    environment = dict(os.environ, DISABLE_AUTOTUNE="1")
    environment.setdefault("TILEGYM_CACHE_DIR", tempfile.mkdtemp(prefix="tilegym-sanitize-"))
    for case in options.cases:  # compile every kernel once, outside the sanitizer
        subprocess.run([sys.executable, "-m", __spec__.name, "--run", case], check=True, env=environment)
    log_dir = options.logs or tempfile.mkdtemp(prefix="tilegym-sanitize-logs-")
    os.makedirs(log_dir, exist_ok=True)
    runs = [(tool, case) for case in options.cases for tool in options.tools if (tool, case) not in _UNCHECKABLE]
    for tool, case in ((tool, case) for case in options.cases for tool in options.tools):
        if (tool, case) in _UNCHECKABLE:
            print(f"{case:28} {tool:10} {'not run':12} {_UNCHECKABLE[tool, case]}")
    with ThreadPoolExecutor(options.jobs) as pool:
        results = list(pool.map(lambda run: _sanitized(*run, environment, log_dir), runs))
    clean = True
    for case, tool, count, kernels in results:
        unit = "hazards" if tool == "racecheck" else "errors"
        shown = "run failed" if count is None else f"{count} {unit}"
        clean = clean and count == 0
        print(f"{case:28} {tool:10} {shown:12} {kernels}")
    print(f"logs in {log_dir}")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
