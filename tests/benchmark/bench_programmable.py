"""Score and mask functions for training: forward + backward of each ready-made function
(tilegym.ops.attention.score_functions) against our built-in switch for the same modifier,
the same function run as written (score_functions.inlined: as a function of one's own runs; the
ready-made softcap and ALiBi run the switch's code, predefined.py), our plain attention,
PyTorch FlexAttention (torch.compile'd, the same functions and inputs) and, for the document
mask, our packed variable-length path on the same documents.

    python tests/benchmark/bench_programmable.py
    python tests/benchmark/bench_programmable.py --seqlens 4096 --functions softcap documents
    python tests/benchmark/bench_programmable.py --replot docs/benchmarks/h100/attention_programmable.json

16384 tokens (batch = 16384 / S), 16 heads, D=128, bf16, causal. "relative" learns its table
[H, 257] (its gradient summed by atomic adds), "relative-frozen" does not. Each cell is the median
time of one training step (forward, then the gradients of q, k, v and the learned table for a
fixed output gradient, by torch.autograd.grad as in the training benchmark), in ms; ours the
fastest of ROUNDS medians, timed in turn with the row's other providers. FlexAttention
runs causal through its block mask (Sq = Sk: its top-left causal is ours). The document mask
cuts each row into 4 documents at random points (a fixed seed).

Targets: FlexAttention's time / ours >= 1.3 (softcap, ALiBi, relative table, documents); our
function's time / our switch's <= 1 (noise aside); the packed path's time / the document mask's
>= 0.9; a function of a few elementwise operations / plain <= 1.1. The last table is Markdown
for the README.
"""

import argparse
import gc
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmark import bench_utils  # noqa: E402

FUNCTIONS = ("softcap", "alibi", "relative", "relative-frozen", "documents")
HEADS, HEAD_DIM, TOKENS, CAP, MAX_DISTANCE, DOCUMENTS = 16, 128, 16384, 30.0, 128, 4
DEFAULT_JSON = Path("bench-out") / "attention_programmable.json"
# Our providers of a row (the function, as written, the switch, plain, packed) are timed in
# turn, ROUNDS times, each keeping its fastest median: a slow phase of the GPU then spoils a
# round of every provider rather than one provider's cell (plain alone moved by 15% between the
# rows of one run timed one after another).
ROUNDS = 3


def _document_ids(batch: int, seqlen: int, generator):
    import torch

    ids = torch.empty((batch, seqlen), dtype=torch.int32)
    lengths = []
    for b in range(batch):
        cuts = sorted((torch.randperm(seqlen - 1, generator=generator)[: DOCUMENTS - 1] + 1).tolist())
        bounds = [0, *cuts, seqlen]
        for doc, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            ids[b, start:end] = doc
            lengths.append(end - start)
    return ids.cuda(), lengths


def providers(function: str, batch: int, seqlen: int, q, k, v):
    """(name -> a callable taking (q, k, v) for one function, plain attention too; FlexAttention's
    callable; the tensors besides q, k, v that a step differentiates: a learned table)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask as flex_block_mask
    from torch.nn.attention.flex_attention import flex_attention

    from tilegym import create_block_mask, tile_fmha_varlen, tile_fmha_with_backward
    from tilegym.ops.attention import score_functions as sf

    # Every function and length compiles FlexAttention anew: past dynamo's default limit of
    # compiles per function it would silently run eagerly (materializing the scores).
    torch._dynamo.config.cache_size_limit = 256  # noqa: SLF001
    torch._dynamo.config.accumulated_cache_size_limit = 4096  # noqa: SLF001
    flex = torch.compile(flex_attention)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    causal_flex = flex_block_mask(causal, None, None, seqlen, seqlen, device="cuda")
    ours = {}
    theirs = None
    learned = ()
    if function == "softcap":
        ours["switch"] = lambda q, k, v: tile_fmha_with_backward(q, k, v, softcap=CAP)
        capped = sf.softcap(CAP)
        ours["function"] = lambda q, k, v: tile_fmha_with_backward(q, k, v, **capped)
        written = sf.inlined(capped)
        ours["as written"] = lambda q, k, v: tile_fmha_with_backward(q, k, v, **written)

        def flex_softcap(score, b, h, q_idx, kv_idx):
            return CAP * torch.tanh(score / CAP)

        theirs = lambda q, k, v: flex(q, k, v, score_mod=flex_softcap, block_mask=causal_flex)  # noqa: E731
    elif function == "alibi":
        slopes = torch.exp2(-torch.arange(1, HEADS + 1, device="cuda", dtype=torch.float32) * 8 / HEADS)
        ours["switch"] = lambda q, k, v: tile_fmha_with_backward(q, k, v, alibi_slopes=slopes)
        alibi = sf.alibi(slopes, seqlen, seqlen)
        ours["function"] = lambda q, k, v: tile_fmha_with_backward(q, k, v, **alibi)
        written = sf.inlined(alibi)
        ours["as written"] = lambda q, k, v: tile_fmha_with_backward(q, k, v, **written)

        def flex_alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx).abs()

        theirs = lambda q, k, v: flex(q, k, v, score_mod=flex_alibi, block_mask=causal_flex)  # noqa: E731
    elif function in ("relative", "relative-frozen"):
        table = torch.randn(HEADS, 2 * MAX_DISTANCE + 1, device="cuda") * 0.1
        table.requires_grad_(function == "relative")
        learned = (table,) if table.requires_grad else ()
        relative = sf.relative_position_bias(table, MAX_DISTANCE)
        ours["function"] = lambda q, k, v: tile_fmha_with_backward(q, k, v, **relative)

        def flex_relative(score, b, h, q_idx, kv_idx):
            bucket = (kv_idx - q_idx).clamp(-MAX_DISTANCE, MAX_DISTANCE) + MAX_DISTANCE
            return score + table[h, bucket]

        theirs = lambda q, k, v: flex(q, k, v, score_mod=flex_relative, block_mask=causal_flex)  # noqa: E731
    elif function == "documents":
        generator = torch.Generator().manual_seed(0)
        ids, lengths = _document_ids(batch, seqlen, generator)
        docs = sf.document_mask(ids)
        mask = create_block_mask(docs["mask_mod"], batch, None, seqlen, seqlen, mask_aux=docs["mask_aux"])
        ours["function"] = lambda q, k, v: tile_fmha_with_backward(q, k, v, block_mask=mask)

        def same_document(b, h, q_idx, kv_idx):
            return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)

        documents_flex = flex_block_mask(same_document, batch, None, seqlen, seqlen, device="cuda")
        theirs = lambda q, k, v: flex(q, k, v, block_mask=documents_flex)  # noqa: E731
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        longest = max(lengths)

        def packed(q, k, v):
            rows = [t.transpose(1, 2).reshape(batch * seqlen, HEADS, HEAD_DIM) for t in (q, k, v)]
            return tile_fmha_varlen(*rows, cu, cu, longest, longest)

        ours["packed"] = packed
    ours["plain"] = lambda q, k, v: tile_fmha_with_backward(q, k, v)
    return ours, theirs, learned


def _step(fn, q, k, v, d_out, learned):
    """One training step's attention: the forward, then the gradients of q, k, v and the learned
    tensors, as the training benchmark takes them (torch.autograd.grad): accumulating them into
    .grad would add three elementwise passes over q, k and v to every provider alike."""
    import torch

    inputs = (q, k, v, *learned)

    def run():
        out = fn(q, k, v)
        torch.autograd.grad(out, inputs, d_out.reshape(out.shape))

    return run


def measure(function: str, seqlen: int) -> dict:
    import torch

    batch = TOKENS // seqlen
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(batch, HEADS, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    d_out = torch.randn_like(q)
    ours, theirs, learned = providers(function, batch, seqlen, q, k, v)
    times = {}
    if theirs is not None:
        try:
            reference = theirs(q, k, v).detach()
            check = ours["function"](q, k, v).detach()
            error = (check.float() - reference.float()).abs().max().item()
            if error > 5e-2:
                raise AssertionError(f"{function}: ours and FlexAttention differ by {error:.3e}")
            times["flex"] = bench_utils.median_ms(_step(theirs, q, k, v, d_out, learned))
        except (RuntimeError, torch._dynamo.exc.BackendCompilerFailed) as error:  # noqa: SLF001
            print(f"FlexAttention failed on {function} S={seqlen}: {str(error).splitlines()[0]}", flush=True)
    # Plain attention has no table to learn.
    steps = {name: _step(fn, q, k, v, d_out, () if name == "plain" else learned) for name, fn in ours.items()}
    for _ in range(ROUNDS):
        for name, step in steps.items():
            ms = bench_utils.median_ms(step, rounds=1)
            times[name] = min(times.get(name, ms), ms)
    del ours, theirs
    gc.collect()
    torch.cuda.empty_cache()
    return times


def ratios(function: str, times: dict) -> dict:
    ours = times["function"]
    result = {}
    if "flex" in times:
        result["flex / ours"] = times["flex"] / ours
    if "switch" in times:
        result["ours function / switch"] = ours / times["switch"]
        result["switch / plain"] = times["switch"] / times["plain"]
    result["ours function / plain"] = ours / times["plain"]
    if "as written" in times:
        result["as written / plain"] = times["as written"] / times["plain"]
        if "flex" in times:
            result["flex / as written"] = times["flex"] / times["as written"]
    if "packed" in times:
        result["packed / mask"] = times["packed"] / ours
    return result


def markdown(results: list[dict]) -> str:
    lines = [
        "| function | S | ours (ms) | as written | built-in switch | plain | FlexAttention | FlexAttention / ours "
        "| FlexAttention / as written | ours / plain | as written / plain | switch / plain | packed / mask |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in results:
        t, r = row["times"], row["ratios"]

        def cell(key, source=t, fmt="{:.2f}"):
            return fmt.format(source[key]) if key in source else "-"

        lines.append(
            f"| {row['function']} | {row['seqlen']} | {cell('function')} | {cell('as written')} | {cell('switch')} | "
            f"{cell('plain')} | {cell('flex')} | {cell('flex / ours', r)} | {cell('flex / as written', r)} | "
            f"{cell('ours function / plain', r)} | {cell('as written / plain', r)} | {cell('switch / plain', r)} | "
            f"{cell('packed / mask', r)} |"
        )
    return "\n".join(lines)


PREFIX = "attention_programmable"


def to_results(rows: list[dict]) -> list:
    """The rows as bench_utils Results (mode fwd+bwd, one per provider; the function is the
    shape's option), for bench_utils.save_json."""
    results = []
    for row in rows:
        seqlen = row["seqlen"]
        shape = bench_utils.Shape(
            TOKENS // seqlen, HEADS, HEADS, seqlen, seqlen, HEAD_DIM, True, "bfloat16", row["function"]
        )
        for provider, ms in row["times"].items():
            results.append(bench_utils.Result("fwd+bwd", provider, shape, ms=ms))
    return results


def from_results(results: list) -> list[dict]:
    """to_results' rows again (for --replot)."""
    rows = {}
    for result in results:
        key = (result.shape.option, result.shape.seqlen_q)
        rows.setdefault(key, {"function": key[0], "seqlen": key[1], "times": {}})["times"][result.provider] = result.ms
    for row in rows.values():
        row["ratios"] = ratios(row["function"], row["times"])
    return list(rows.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=bench_utils.HelpFormatter)
    p.add_argument("--seqlens", nargs="+", type=int, default=[4096, 16384], help="sequence lengths; batch = 16384 / S")
    p.add_argument("--functions", nargs="+", choices=FUNCTIONS, default=list(FUNCTIONS), help="functions to time")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where the results go")
    p.add_argument("--replot", type=Path, metavar="JSON", help="measure nothing: print the tables of an earlier run")
    args = p.parse_args()
    if args.replot:
        results, _ = bench_utils.read_results(args.replot)
        print(markdown(from_results(results)))
        return
    import torch  # noqa: F401  (after parsing: --help needs no GPU stack)

    rows = []
    started_all = time.perf_counter()
    for seqlen in args.seqlens:
        for function in args.functions:
            started = time.perf_counter()
            times = measure(function, seqlen)
            row = {"function": function, "seqlen": seqlen, "times": times, "ratios": ratios(function, times)}
            rows.append(row)
            shown = " ".join(f"{name}={ms:.3f}" for name, ms in times.items())
            shown_ratios = " ".join(f"{name}={value:.2f}" for name, value in row["ratios"].items())
            print(f"{function:10s} S={seqlen:6d} {shown} | {shown_ratios} ({time.perf_counter() - started:.0f} s)")
    meta = {
        "benchmark": PREFIX,
        **bench_utils._environment(),  # noqa: SLF001
        "command": " ".join(["python", *sys.argv]),
        "shape": f"{TOKENS} tokens, H={HEADS}, D={HEAD_DIM}, bf16, causal",
        "unit": "ms per training step (forward + backward), median",
        "wall_seconds": round(time.perf_counter() - started_all, 1),
    }
    bench_utils.save_json(to_results(rows), args.json, meta)
    print(markdown(rows))
    if any(math.isnan(ms) for row in rows for ms in row["times"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
