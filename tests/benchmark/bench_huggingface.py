"""A Hugging Face transformers decoder's training step (forward, loss, backward into every
parameter) with its attention on tilegym (tilegym.integrations.huggingface) against the same
model on transformers' "sdpa" (PyTorch's SDPA: cuDNN or FlashAttention-2 inside where no mask is
made, its memory-efficient or math kernels where one is).

    python tests/benchmark/bench_huggingface.py
    python tests/benchmark/bench_huggingface.py --layers 2 --tokens 8192 --head-dim 64

A Llama-shaped model (hidden 2048, Hq = 2048 / D, Hkv = Hq / 2, MLP 5632, vocab 32000), bf16,
built from its config (no download). Batches of --tokens tokens:

- causal: rows of --seqlen tokens, no mask (both run plain causal attention);
- left-padding: the same rows, row r padded on the left by r / B of its length (a 4D mask);
- packed: one row of documents with lengths drawn uniformly in [128, --seqlen] (seed 0),
  position_ids restarting per document (transformers makes a block-diagonal 4D mask);
- packed-flash-kwargs (ours alone): the same documents by cu_seq_lens_q / cu_seq_lens_k and no
  position_ids, as a flattening collator passes them for FlashAttention: no mask is made and
  the packed variable-length kernels run (RoPE is relative, so the positions' offset within the
  row does not change the attention).

Median ms per step over a few rounds (bench_utils.median_ms) and SDPA's time over ours.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmark import bench_utils  # noqa: E402
from tests.benchmark.bench_varlen import MIN_LEN, SEED, draw_lengths  # noqa: E402

SCENARIOS = ("causal", "left-padding", "packed", "packed-flash-kwargs")


def _inputs(scenario: str, tokens: int, seqlen: int, vocab: int):
    import torch

    generator = torch.Generator().manual_seed(0)
    if scenario in ("causal", "left-padding"):
        rows = tokens // seqlen
        ids = torch.randint(0, vocab, (rows, seqlen), generator=generator)
        inputs = {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
        if scenario == "left-padding":
            mask = torch.ones_like(ids)
            for row in range(rows):
                mask[row, : seqlen * row // rows] = 0
            inputs["attention_mask"] = mask
            inputs["labels"] = ids.masked_fill(mask == 0, -100)
        return {name: t.cuda() if isinstance(t, torch.Tensor) else t for name, t in inputs.items()}
    lengths = draw_lengths(tokens, MIN_LEN, seqlen, SEED)
    ids = torch.randint(0, vocab, (1, tokens), generator=generator)
    # No cache: transformers reads packing from position_ids only without one.
    inputs = {"input_ids": ids.cuda(), "labels": ids.cuda(), "use_cache": False}
    if scenario == "packed":
        inputs["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    else:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        inputs |= {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths)}
    return inputs


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=bench_utils.HelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step")
    p.add_argument("--seqlen", type=int, default=4096, help="row length, and the longest document when packed")
    p.add_argument("--head-dim", type=int, default=128, help="D; Hq = 2048 / D")
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS), help="batches to time")
    args = p.parse_args(argv)

    import torch
    import transformers

    from tilegym.integrations import huggingface

    huggingface.register()
    heads = 2048 // args.head_dim
    config_kwargs = {
        "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": args.layers,
        "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2), "head_dim": args.head_dim,
        "max_position_embeddings": args.tokens, "attention_dropout": 0.0,
    }  # fmt: skip
    torch.manual_seed(0)
    models = {}
    for provider in ("sdpa", huggingface.NAME):
        config = transformers.LlamaConfig(**config_kwargs)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=provider)
        if models:
            model.load_state_dict(next(iter(models.values())).state_dict())
        models[provider] = model.to(device="cuda", dtype=torch.bfloat16).train()

    print(f"Llama-shaped, {args.layers} layers, D={args.head_dim}, Hq={heads}, bf16, {args.tokens} tokens per step")
    print("| scenario | sdpa ms | ours ms | sdpa / ours |")
    print("| --- | --- | --- | --- |")
    for scenario in args.scenarios:
        inputs = _inputs(scenario, args.tokens, args.seqlen, config_kwargs["vocab_size"])
        times = {}
        for provider, model in models.items():
            if scenario == "packed-flash-kwargs" and provider == "sdpa":
                continue  # SDPA reads no cumulative lengths: it would attend across documents

            def step(model=model, inputs=inputs):
                loss = model(**inputs).loss
                loss.backward()
                model.zero_grad(set_to_none=True)

            times[provider] = bench_utils.median_ms(step, warmup_ms=200, rep_ms=1000)
        ours, sdpa = times[huggingface.NAME], times.get("sdpa")
        ratio = "-" if sdpa is None else f"{sdpa / ours:.2f}x"
        print(f"| {scenario} | {'-' if sdpa is None else f'{sdpa:.2f}'} | {ours:.2f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
