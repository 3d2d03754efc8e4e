"""tilegym attention inside Hugging Face transformers models built from tiny configs (no
downloads), against the same models and weights on transformers' eager attention: logits at
every non-padded position and the gradients of every parameter.

Without a GPU the models run on the CPU with the kernels replaced by the float64 reference
(_reference_attention), which checks how each layer's call is translated (masks, windows,
packing, sinks, softcap, scaling) whatever the hardware; with one, the kernels run.
"""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.ops.attention_cases import rms_error  # noqa: E402
from tests.ops.conftest import requires_cuda  # noqa: E402
from tilegym.integrations import huggingface  # noqa: E402
from tilegym.ops.attention.reference import attention_reference, dropout_kept  # noqa: E402

VOCAB = 97
_COMMON = {
    "vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
    "attention_dropout": 0.0,
}  # fmt: skip


def _config(family: str):
    if family == "llama":
        return transformers.LlamaConfig(**_COMMON)
    if family == "mistral":  # a sliding window on every layer
        return transformers.MistralConfig(**_COMMON, sliding_window=8)
    if family == "gemma2":  # softcapping, its own scaling, sliding and full layers
        return transformers.Gemma2Config(
            **_COMMON, attn_logit_softcapping=20.0, sliding_window=8, query_pre_attn_scalar=24
        )
    if family == "gpt_oss":  # learned sinks, sliding and full layers
        return transformers.GptOssConfig(**_COMMON, sliding_window=8, num_local_experts=4, num_experts_per_tok=2)
    raise ValueError(family)


FAMILIES = ["llama", "mistral", "gemma2", "gpt_oss"]


def _models(family: str, dtype, device):
    """(ours, eager) with the same weights."""
    huggingface.register()
    torch.manual_seed(0)
    # A config each: from_config sets the attention implementation on the config it is given.
    eager = transformers.AutoModelForCausalLM.from_config(_config(family), attn_implementation="eager")
    if family == "gpt_oss":  # sinks start at zero: make them matter
        for layer in eager.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
    eager = eager.to(device=device, dtype=dtype).train()
    ours = transformers.AutoModelForCausalLM.from_config(_config(family), attn_implementation=huggingface.NAME)
    ours.load_state_dict(eager.state_dict())
    assert (ours.config._attn_implementation, eager.config._attn_implementation) == (huggingface.NAME, "eager")
    return ours.to(device=device, dtype=dtype).train(), eager


def _batch(scenario: str, device) -> tuple[dict, torch.Tensor]:
    """(the model's inputs, bool [B, S]: the positions whose logits count). Training calls: no
    cache (transformers reads packing from position_ids only without one)."""
    generator = torch.Generator().manual_seed(1)
    if scenario in ("plain", "left-padding", "right-padding"):
        ids = torch.randint(0, VOCAB, (3, 21), generator=generator)
        valid = torch.ones(ids.shape, dtype=torch.bool)
        if scenario == "left-padding":
            valid[1, :6], valid[2, :17] = False, False
        elif scenario == "right-padding":
            valid[0, 15:], valid[2, 3:] = False, False
        inputs = {"input_ids": ids, "use_cache": False}
        if scenario != "plain":
            inputs["attention_mask"] = valid.long()
        return {name: _to(t, device) for name, t in inputs.items()}, valid.to(device)
    lengths = [7, 11, 1, 13]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    inputs = {"input_ids": ids, "position_ids": positions, "use_cache": False}
    if scenario == "packed-flash-kwargs":  # as DataCollatorWithFlattening(return_flash_attn_kwargs=True)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        inputs = {"input_ids": ids, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "use_cache": False}
        inputs |= {"max_length_q": max(lengths), "max_length_k": max(lengths)}
    return {name: _to(t, device) for name, t in inputs.items()}, torch.ones(ids.shape, dtype=torch.bool, device=device)


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


SCENARIOS = ["plain", "left-padding", "right-padding", "packed-position-ids", "packed-flash-kwargs"]


def _eager_run(eager, scenario, inputs):
    """The eager model's logits. A batch packed by FlashAttention's keyword arguments alone is
    beyond eager attention (it would attend across sequences): each sequence runs by itself."""
    if scenario != "packed-flash-kwargs":
        return eager(**inputs).logits
    cu = inputs["cu_seq_lens_q"].tolist()
    ids = inputs["input_ids"]
    pieces = [
        eager(input_ids=ids[:, start:end], use_cache=False).logits for start, end in zip(cu[:-1], cu[1:], strict=True)
    ]
    return torch.cat(pieces, dim=1)


def _compare(family, scenario, dtype, device, logits_tolerance, grad_tolerance):
    ours, eager = _models(family, dtype, device)
    inputs, valid = _batch(scenario, device)
    weights = torch.randn(*valid.shape, VOCAB, dtype=dtype, device=device) * valid[..., None]
    results = []
    for model, run in ((ours, lambda: ours(**inputs).logits), (eager, lambda: _eager_run(eager, scenario, inputs))):
        logits = run()
        grads = torch.autograd.grad((logits * weights).sum(), [p for p in model.parameters() if p.requires_grad])
        results.append((logits, grads))
    (our_logits, our_grads), (eager_logits, eager_grads) = results
    assert _relative_rms(our_logits[valid], eager_logits[valid]) < logits_tolerance
    names = [name for name, p in ours.named_parameters() if p.requires_grad]
    for name, mine, theirs in zip(names, our_grads, eager_grads, strict=True):
        assert _relative_rms(mine, theirs) < grad_tolerance, name


def _compare_decoding(family, dtype, device, logits_tolerance):
    """Generation with a cache from a left-padded prompt: the prefill, then steps of one query
    fed the eager model's greedy tokens, each step's logits compared."""
    ours, eager = _models(family, dtype, device)
    inputs, valid = _batch("left-padding", device)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    caches = [transformers.DynamicCache(config=model.config) for model in (ours, eager)]
    with torch.no_grad():
        for step in range(5):
            logits = [
                model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]
                for model, cache in zip((ours, eager), caches, strict=True)
            ]
            assert _relative_rms(*logits) < logits_tolerance, step
            ids = logits[1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)


def _relative_rms(ours: torch.Tensor, expected: torch.Tensor) -> float:
    scale = rms_error(expected, torch.zeros_like(expected))
    return rms_error(ours, expected) / scale if scale > 0 else rms_error(ours, expected)


# ---- the translation, checked on the CPU against the reference ---------------------------------


def _reference_attention(q, k, v, scaling=None, is_causal=True, **kwargs):
    """tile_fmha_functional's meaning in float64 for the arguments attention_forward passes: dense
    or packed, window, softcap, sinks, attn_bias and its two mask functions (given as mask_mod or
    in a block mask)."""
    # The models here have no attention dropout (test_dropout_is_passed_on checks the rate's way).
    assert kwargs.pop("dropout_p", 0.0) == 0.0
    cu_q, cu_k = kwargs.pop("cu_seqlens_q", None), kwargs.pop("cu_seqlens_k", None)
    longest = kwargs.pop("max_seqlen_q", None), kwargs.pop("max_seqlen_k", None)
    if cu_q is not None:
        # What tile_fmha_varlen takes: int32 cumulative lengths on q's device, Python int lengths
        # that cover every sequence.
        for cu, most in zip((cu_q, cu_k), longest, strict=True):
            assert cu.dtype == torch.int32 and cu.device == q.device and cu.dim() == 1
            assert type(most) is int and most == int((cu[1:] - cu[:-1]).max())
        assert q.dim() == 3 and q.shape[0] == int(cu_q[-1])
        pieces = []
        for s in range(cu_q.numel() - 1):
            rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
            one = (t[span].transpose(0, 1)[None] for t, span in ((q, rows), (k, keys), (v, keys)))
            pieces.append(_reference_attention(*one, scaling, is_causal, **kwargs)[0].transpose(0, 1))
        return torch.cat(pieces)
    mask_mod, mask_aux = kwargs.pop("mask_mod", None), kwargs.pop("mask_aux", None)
    block_mask = kwargs.pop("block_mask", None)
    if block_mask is not None:
        mask_mod, mask_aux = block_mask.mask_mod, block_mask.mask_aux
    score_mod = None
    if mask_mod is not None:
        seen = mask_aux[0].bool()
        seen = seen[:, None] if mask_mod is huggingface._seen_by_batch_entry else seen
        score_mod = lambda scores, b, h, i, j: scores.masked_fill(~seen, -math.inf)  # noqa: E731
    out, _ = attention_reference(q, k, v, scaling, is_causal, score_mod=score_mod, **kwargs)
    return out.to(q.dtype)


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("family", FAMILIES)
def test_translation_matches_eager(family, scenario, monkeypatch):
    monkeypatch.setattr(huggingface, "tile_fmha_functional", _reference_attention)
    _compare(family, scenario, torch.float32, "cpu", 1e-5, 1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_translation_matches_eager_decoding(family, monkeypatch):
    monkeypatch.setattr(huggingface, "tile_fmha_functional", _reference_attention)
    _compare_decoding(family, torch.float32, "cpu", 1e-5)


def test_dropout_is_passed_on(monkeypatch):
    """The layer's attention dropout reaches the kernels' dropout_p, dense and packed."""
    given = []

    def record(q, k, v, scaling=None, is_causal=True, **kwargs):
        given.append(kwargs.get("dropout_p"))
        return torch.zeros_like(q)

    monkeypatch.setattr(huggingface, "tile_fmha_functional", record)
    q = torch.randn(1, 2, 4, 32)
    module = torch.nn.Module()
    huggingface.attention_forward(module, q, q, q, None, dropout=0.1)
    cu = torch.tensor([0, 1, 4], dtype=torch.int32)
    huggingface.attention_forward(module, q, q, q, None, dropout=0.25, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                  max_length_q=3, max_length_k=3)  # fmt: skip
    huggingface.attention_forward(module, q, q, q, None)
    assert given == [0.1, 0.25, 0.0]


def test_refusals():
    """A position bias is refused, naming what to change."""
    q = torch.randn(1, 2, 4, 32)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="position bias"):
        huggingface.attention_forward(module, q, q, q, None, position_bias=torch.zeros(1, 2, 4, 4))
    with pytest.raises(ValueError, match=r"attention_mask must have shape \[1 or 1, 1 or 2, 4, 4\]"):
        huggingface.attention_forward(module, q, q, q, torch.ones(1, 1, 4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="packed into one row"):
        cu = torch.tensor([0, 2, 4], dtype=torch.int32)
        q2 = torch.randn(2, 2, 4, 32)
        huggingface.attention_forward(module, q2, q2, q2, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_block_masks_kept_per_mask_tensor(monkeypatch):
    """A mask's block mask is made once for all layers of a step (the model passes them one mask
    tensor), sorted per batch entry of the mask alone (not per head), and made again for a new
    mask, an in-place change of it, or other call sizes."""
    made = []
    real = huggingface.create_block_mask
    monkeypatch.setattr(huggingface, "create_block_mask", lambda *a, **k: made.append(a[1:3]) or real(*a, **k))
    monkeypatch.setattr(huggingface, "tile_fmha_functional", _reference_attention)
    huggingface._BLOCK_MASKS.clear()
    ours, _ = _models("llama", torch.float32, "cpu")
    inputs, _ = _batch("left-padding", "cpu")
    ours(**inputs)
    assert made == [(3, None)]  # two layers, one mask of 3 entries, heads broadcast
    q = torch.randn(1, 2, 4, 32)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    first = huggingface._as_mask(mask, q, q)["block_mask"]
    assert huggingface._as_mask(mask, q, q)["block_mask"] is first
    mask[0, 0, 3, 0] = False  # in place: a new version
    assert huggingface._as_mask(mask, q, q)["block_mask"] is not first
    assert huggingface._as_mask(mask, torch.randn(1, 2, 4, 32), torch.randn(1, 2, 4, 32))["block_mask"] is not None
    assert len(huggingface._BLOCK_MASKS) <= huggingface._BLOCK_MASKS.kept


# gpt-oss's masks in transformers do not follow a packing by position_ids (its full layers get no
# mask, its sliding ones a window across sequences): its calls read them as they are.
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_masks_of_packed_position_ids_run_the_packed_kernels(family, monkeypatch):
    """Sequences packed by position_ids: every layer's mask (causal, and windowed in sliding
    layers) is the packing's own, so every call runs the packed kernels."""
    packed_calls = []

    def spy(*args, **kwargs):
        packed_calls.append("cu_seqlens_q" in kwargs)
        return _reference_attention(*args, **kwargs)

    monkeypatch.setattr(huggingface, "tile_fmha_functional", spy)
    huggingface._PACKINGS.clear()
    ours, _ = _models(family, torch.float32, "cpu")
    ours(**_batch("packed-position-ids", "cpu")[0])
    assert len(packed_calls) == ours.config.num_hidden_layers and all(packed_calls)


@pytest.mark.parametrize("change", ["exact", "one-pair-hidden", "one-pair-shown", "positions-differ"])
def test_a_mask_other_than_the_packing_is_read(change, monkeypatch):
    """Only a mask equal to the packing's own runs the packed kernels; any other is read as a
    mask. Either way the output is the reference's for that mask."""
    kinds = []

    def spy(*args, **kwargs):
        kinds.append("packed" if "cu_seqlens_q" in kwargs else "mask")
        return _reference_attention(*args, **kwargs)

    monkeypatch.setattr(huggingface, "tile_fmha_functional", spy)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    sequence = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    mask = (sequence[:, None] == sequence[None, :]) & torch.ones(8, 8, dtype=torch.bool).tril()
    if change == "one-pair-hidden":
        mask[6, 4] = False
    elif change == "one-pair-shown":
        mask[4, 1] = True
    elif change == "positions-differ":
        positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    q, k, v = (torch.randn(1, 2, 8, 32) for _ in range(3))
    module = torch.nn.Module()
    out, _ = huggingface.attention_forward(module, q, k, v, mask[None, None], position_ids=positions)
    assert kinds == ["packed" if change == "exact" else "mask"]
    hide = lambda scores, b, h, i, j: scores.masked_fill(~mask, -math.inf)  # noqa: E731
    expected, _ = attention_reference(q, k, v, None, False, score_mod=hide)
    torch.testing.assert_close(out, expected.float().transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_register_names_both_interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert huggingface.register("tilegym-test") == "tilegym-test"
    assert AttentionInterface._global_mapping["tilegym-test"] is huggingface.attention_forward
    assert AttentionMaskInterface._global_mapping["tilegym-test"] is huggingface.attention_mask


# ---- the kernels -------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("family", FAMILIES)
def test_op_huggingface_models(family, scenario):
    """float32 models on the kernels against eager attention in float32."""
    _compare(family, scenario, torch.float32, "cuda", 2e-3, 5e-3)


@requires_cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_op_huggingface_decoding(family):
    _compare_decoding(family, torch.float32, "cuda", 2e-3)


@requires_cuda
@pytest.mark.parametrize("scenario", ["plain", "packed-position-ids"])
def test_op_huggingface_training_with_dropout(scenario, monkeypatch):
    """A training step of a model with attention dropout on the kernels against the same model on
    the float64 reference attention given the kernels' masks (each layer's call a seed of its
    own, in order): logits and every parameter's gradient. In eval the dropout is off."""
    from tilegym.ops.attention import dropout

    config = _config("llama")
    config.attention_dropout = 0.3
    huggingface.register()
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=huggingface.NAME)
    ours = ours.to(device="cuda", dtype=torch.float32).train()
    inputs, valid = _batch(scenario, "cuda")
    weights = torch.randn(*valid.shape, VOCAB, device="cuda")
    seeds = [torch.tensor([101 + 2 * n, 202 + 3 * n, 0, 0], dtype=torch.int32) for n in range(config.num_hidden_layers)]
    drawn = iter(seeds)
    monkeypatch.setattr(dropout, "new_seed", lambda device: next(drawn).to(device))

    def step():
        logits = ours(**inputs).logits
        return logits, torch.autograd.grad((logits * weights).sum(), list(ours.parameters()))

    mine, my_grads = step()
    assert next(drawn, None) is None, "one seed per layer"

    calls = iter(seeds)

    def reference(q, k, v, scaling=None, is_causal=True, *, dropout_p, window_size, softcap, sinks, **packing):
        """The reference on the kernels' mask of the layer's seed; a packed batch one sequence at a time."""
        assert (window_size, softcap, sinks) == (None, None, None) and is_causal
        assert set(packing) in (set(), {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"})
        seed = next(calls)
        if not packing:
            batch, heads, seqlen_q, _ = q.shape
            kept = dropout_kept(seed, dropout_p, batch, heads, seqlen_q, k.shape[2]).cuda()
            out, _ = attention_reference(q, k, v, scaling, is_causal, dropout_kept=kept,
                                         dropout_scale=dropout.kept_scale(dropout_p))  # fmt: skip
            return out.to(q.dtype)
        bounds = packing["cu_seqlens_q"].tolist()
        pieces = []
        for number, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            one = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]  # [1, heads, length, D]
            kept = dropout_kept(seed, dropout_p, 1, q.shape[1], end - start, end - start, first_sequence=number)
            out, _ = attention_reference(*one, scaling, is_causal, dropout_kept=kept.cuda(),
                                         dropout_scale=dropout.kept_scale(dropout_p))  # fmt: skip
            pieces.append(out[0].transpose(0, 1))
        return torch.cat(pieces).to(q.dtype)

    monkeypatch.setattr(huggingface, "tile_fmha_functional", reference)
    theirs, their_grads = step()
    assert _relative_rms(mine[valid], theirs[valid]) < 2e-3
    for (name, _), mine_grad, their_grad in zip(ours.named_parameters(), my_grads, their_grads, strict=True):
        assert _relative_rms(mine_grad, their_grad) < 5e-3, name

    monkeypatch.undo()
    with torch.no_grad():
        evaluated = ours.eval()(**inputs).logits
        config_without = _config("llama")
        plain = transformers.AutoModelForCausalLM.from_config(config_without, attn_implementation="eager")
        plain.load_state_dict(ours.state_dict())
        expected = plain.to(device="cuda", dtype=torch.float32).eval()(**inputs).logits
    assert _relative_rms(evaluated[valid], expected[valid]) < 2e-3


@requires_cuda
def test_op_huggingface_under_torch_compile():
    """A padded batch through torch.compile of the model (its masks as mask functions in the
    graph) against eager attention: logits and gradients."""
    ours, eager = _models("llama", torch.float32, "cuda")
    inputs, valid = _batch("left-padding", "cuda")
    compiled = torch.compile(ours)
    weights = torch.randn(*valid.shape, VOCAB, device="cuda") * valid[..., None]
    results = []
    for model, run in ((ours, lambda: compiled(**inputs).logits), (eager, lambda: eager(**inputs).logits)):
        logits = run()
        results.append((logits, torch.autograd.grad((logits * weights).sum(), list(model.parameters()))))
    (mine, my_grads), (theirs, their_grads) = results
    assert _relative_rms(mine[valid], theirs[valid]) < 2e-3
    for ours_grad, eager_grad in zip(my_grads, their_grads, strict=True):
        assert _relative_rms(ours_grad, eager_grad) < 5e-3
