"""transformers models on our attention under huggingface.context_parallel, each rank holding a
share of the sequences, against the same model on eager attention over the whole sequences:
each rank's logits, and every parameter's gradient summed over the ranks.

Without a GPU the ranks talk over gloo on the CPU, with the kernels replaced by the float64
reference (tests/test_context_parallel.py's stand-in); with one, two ranks share it over gloo
and the kernels run. float32 models, as tests/test_huggingface.py compares them (eager
attention takes its softmax in float32).
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

transformers = pytest.importorskip("transformers")

from tests.ops.conftest import requires_cuda  # noqa: E402
from tests.test_context_parallel import _reference_functional  # noqa: E402
from tests.test_huggingface import VOCAB, _models, _relative_rms  # noqa: E402
from tilegym.integrations import huggingface  # noqa: E402
from tilegym.ops.attention import dropout  # noqa: E402
from tilegym.parallel import context, packed, packed_positions, sequence_positions, shard_packed  # noqa: E402

WORLD = 2
CHUNK = 7  # positions per chunk: sequences of 2 x WORLD x CHUNK, past the sliding windows of 8
LENGTHS = (3, 1, 5)  # packed: each sequence this many times 2 x WORLD
FAMILIES = ["llama", "mistral", "gemma2", "gpt_oss"]


def _whole_and_share(family: str, scenario: str, rank: int, device):
    """(the model's inputs on this rank, the eager model's inputs per whole sequence, a function
    cutting this rank's share from a whole [B, S, ...] tensor)."""
    generator = torch.Generator().manual_seed(3)
    if scenario == "sequences":
        length = 2 * WORLD * CHUNK
        ids = torch.randint(0, VOCAB, (2, length), generator=generator).to(device)
        positions = sequence_positions(length, device=device)

        def share(t):
            return t[:, positions]

        ours = {"input_ids": share(ids), "position_ids": positions[None].expand(2, -1), "use_cache": False}
        return ours, [ids], share
    lengths = [2 * WORLD * n for n in LENGTHS]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    ids = torch.randint(0, VOCAB, (1, int(cu[-1])), generator=generator).to(device)

    def share(t):
        return shard_packed(t[0], cu)[None]

    mine = share(ids)
    ours = {
        "input_ids": mine, "position_ids": packed_positions(cu, mine.shape[1])[None], "use_cache": False,
        "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths),
    }  # fmt: skip
    pieces = [ids[:, start:stop] for start, stop in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]
    return ours, pieces, share


def _compare(family: str, scenario: str, rank: int, dtype, device, logits_tolerance, grad_tolerance) -> None:
    ours, eager = _models(family, dtype, device)
    inputs, whole_pieces, share = _whole_and_share(family, scenario, rank, device)
    eager_logits = torch.cat([eager(input_ids=ids, use_cache=False).logits for ids in whole_pieces], dim=1)
    generator = torch.Generator().manual_seed(4)
    weights = torch.randn(eager_logits.shape, generator=generator, dtype=torch.float64).to(device, dtype)
    parameters = [[p for p in model.parameters() if p.requires_grad] for model in (ours, eager)]
    eager_grads = torch.autograd.grad((eager_logits * weights).sum(), parameters[1])
    with huggingface.context_parallel():
        our_logits = ours(**inputs).logits
    our_grads = torch.autograd.grad((our_logits * share(weights)).sum(), parameters[0], allow_unused=True)
    assert _relative_rms(our_logits, share(eager_logits)) < logits_tolerance, (family, scenario)
    if scenario == "sequences":
        _compare_loss(ours, eager, inputs, whole_pieces[0], share, logits_tolerance)
    names = [name for name, p in ours.named_parameters() if p.requires_grad]
    for name, mine, theirs in zip(names, our_grads, eager_grads, strict=True):
        mine = torch.zeros_like(theirs) if mine is None else mine.contiguous()
        dist.all_reduce(mine)  # each rank's share of the whole loss's gradient
        assert _relative_rms(mine, theirs) < grad_tolerance, (family, scenario, name)


def _compare_loss(ours, eager, inputs, ids, share, tolerance) -> None:
    """The causal LM loss as the README says to take it: shift_labels shifted on the whole
    sequence, sharded like the inputs, each rank's loss over the whole batch's item count; their
    sum is the whole sequence's loss."""
    shifted = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    items = (shifted != -100).sum()
    expected = eager(input_ids=ids, labels=ids, use_cache=False, num_items_in_batch=items).loss
    with huggingface.context_parallel():
        mine = ours(**inputs, labels=share(ids), shift_labels=share(shifted), num_items_in_batch=items).loss
    total = mine.detach().clone()
    dist.all_reduce(total)
    assert abs(total.item() - expected.item()) <= tolerance * abs(expected.item()), (total.item(), expected.item())


def _compare_dropout(rank: int, device, on_gpu: bool, tolerance: float) -> None:
    """A model with attention dropout in training under context_parallel against the same model
    on the whole sequence, both drawing the same seeds (one per layer, in order): the chunks
    draw their rows of the whole sequence's masks. Logits, and gradients summed over the ranks."""
    from tests.test_huggingface import _config

    config = _config("llama")
    config.attention_dropout = 0.3
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=huggingface.NAME)
    model = model.to(device=device, dtype=torch.float32).train()
    inputs, (ids,), share = _whole_and_share("llama", "sequences", rank, device)
    parameters = [p for p in model.parameters() if p.requires_grad]
    weights = torch.randn((*ids.shape, VOCAB), generator=torch.Generator().manual_seed(5)).to(device)

    def step(run):
        seeds = iter([torch.tensor([31 + n, 47 + n, 0, 0], dtype=torch.int32) for n in range(config.num_hidden_layers)])
        dropout.new_seed = lambda on: next(seeds).to(on)
        logits = run()
        assert next(seeds, None) is None, "one seed per layer"
        return logits

    whole = step(lambda: model(input_ids=ids, use_cache=False).logits)
    whole_grads = torch.autograd.grad((whole * weights).sum(), parameters)
    with huggingface.context_parallel():
        mine = step(lambda: model(**inputs).logits)
    my_grads = torch.autograd.grad((mine * share(weights)).sum(), parameters, allow_unused=True)
    assert _relative_rms(mine, share(whole)) < tolerance
    for mine_grad, whole_grad in zip(my_grads, whole_grads, strict=True):
        mine_grad = torch.zeros_like(whole_grad) if mine_grad is None else mine_grad.contiguous()
        dist.all_reduce(mine_grad)
        assert _relative_rms(mine_grad, whole_grad) < 2 * tolerance


def _whole_reference(q, k, v, scaling=None, is_causal=True, **kwargs):
    """tile_fmha_functional's meaning for a layer's call on the whole sequence (the CPU stand-in)."""
    return _reference_functional(q, k, v, scaling, is_causal, True, return_lse=True, **kwargs)[0]


def _worker(rank: int, init_file: str, on_gpu: bool) -> None:
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if not on_gpu:
        for module in (context, packed):
            module.tile_fmha_functional = _reference_functional
        context.check_inputs = packed.check_packed_inputs = lambda *args, **kwargs: None
        huggingface.tile_fmha_functional = _whole_reference
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        for family in FAMILIES:
            for scenario in ("sequences", "packed"):
                if on_gpu:
                    _compare(family, scenario, rank, torch.float32, device, 2e-3, 5e-3)
                else:
                    _compare(family, scenario, rank, torch.float32, device, 1e-5, 1e-4)
        _compare_dropout(rank, device, on_gpu, 2e-3 if on_gpu else 1e-6)
    finally:
        dist.destroy_process_group()


def test_models_under_context_parallel(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"), False), nprocs=WORLD)


@requires_cuda
def test_op_models_under_context_parallel(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"), True), nprocs=WORLD)


def test_refusals_under_context_parallel():
    module = torch.nn.Module()
    module.is_causal = True
    q = torch.randn(1, 2, 4, 32)
    longer = torch.randn(1, 2, 6, 32)
    padding = torch.tensor([[False, True, True, True]])
    with huggingface.context_parallel():
        with pytest.raises(ValueError, match="an attention mask reached a layer"):
            huggingface.attention_forward(module, q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))
        with pytest.raises(ValueError, match="use_cache=False"):
            huggingface.attention_forward(module, q, longer, longer, None)
        with pytest.raises(ValueError, match="padding"):
            huggingface.attention_mask(
                batch_size=1, cache_position=torch.arange(4), kv_length=4, attention_mask=padding
            )
        assert huggingface.attention_mask(batch_size=1, cache_position=torch.arange(4), kv_length=4) is None
        cu = torch.tensor([0, 4], dtype=torch.int32)
        with pytest.raises(ValueError, match="attention dropout .* on packed sequences"):
            huggingface.attention_forward(module, q, q, q, None, dropout=0.1, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                          max_length_q=4, max_length_k=4)  # fmt: skip
    assert not huggingface._CONTEXT_PARALLEL  # left on the way out
    with pytest.raises(ValueError, match="layout"), huggingface.context_parallel(layout="ring"):
        pass
