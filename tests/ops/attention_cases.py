"""Shapes the attention tests run, each with the reason it is there, and the tolerance rule."""

from dataclasses import dataclass

import torch

from tilegym.ops.attention.reference import attention_reference


@dataclass(frozen=True)
class Case:
    why: str
    batch: int
    q_heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int

    def __str__(self):
        return self.why


REGULAR = [
    Case("regular", 2, 4, 4, 256, 256, 64),
    Case("regular-d128", 2, 4, 4, 512, 512, 128),
]
# Cases other test files name one by one as well.
ODD_LENGTHS = Case("odd-lengths", 2, 3, 3, 77, 77, 64)
SQ_GT_SK = Case("sq-gt-sk", 2, 2, 2, 300, 100, 64)  # causal: the first 200 queries see no key
GQA_4TO1 = Case("gqa-4to1", 1, 8, 2, 130, 257, 128)
MQA = Case("mqa", 2, 6, 1, 97, 97, 128)

IRREGULAR = [
    ODD_LENGTHS,
    Case("prime-lengths", 1, 2, 2, 251, 131, 128),
    Case("seqlen-1", 2, 2, 2, 1, 1, 64),
    Case("one-query-many-keys", 1, 2, 2, 1, 300, 64),
    Case("many-queries-one-key", 1, 2, 2, 300, 1, 64),
    Case("just-past-a-tile", 1, 2, 2, 129, 129, 128),
]
CORNERS = [
    Case("batch1-head1", 1, 1, 1, 128, 128, 64),
    Case("many-heads", 1, 48, 48, 64, 64, 32),
    Case("short", 3, 2, 2, 5, 7, 64),
]
SEQLEN_MISMATCH = [
    Case("sq-lt-sk", 2, 2, 2, 100, 300, 64),
    SQ_GT_SK,
    Case("sq-gt-sk-tiny", 1, 2, 2, 70, 3, 128),
]
GQA = [
    Case("gqa-2to1", 2, 8, 4, 200, 200, 64),
    GQA_4TO1,
    Case("gqa-8to1", 1, 16, 2, 256, 256, 64),
    MQA,
]
HEAD_DIMS = [Case(f"d{d}", 1, 2, 2, 150, 150, d) for d in (32, 64, 80, 96, 128, 192, 256)]

# Our RMS error against the fp64 reference may be at most ERROR_RATIO times PyTorch SDPA's,
# plus EPS; our max error at most MAX_ERROR_RATIO times SDPA's, plus EPS.
ERROR_RATIO = 2.0
MAX_ERROR_RATIO = 4.0
EPS = {torch.float16: 1e-4, torch.bfloat16: 1e-3, torch.float32: 1e-6, torch.float64: 1e-12}


def max_error(actual, expected) -> float:
    return (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0


def rms_error(actual, expected) -> float:
    return (actual.double() - expected.double()).square().mean().sqrt().item() if actual.numel() else 0.0


def assert_close_to_reference(name, ours, baseline, reference, dtype):
    """The tolerance rule on two statistics of the error against the fp64 reference, where
    baseline is PyTorch (SDPA or its math) in the inputs' dtype.

    RMS error: at most ERROR_RATIO x the baseline's, plus EPS; a stable measure of precision.
    Max error: at most MAX_ERROR_RATIO x the baseline's, plus EPS; catches a few wrong elements
    (one bad tile) that an RMS would average away, without the noise of a single worst draw.
    """
    assert not ours.isnan().any(), f"{name} has NaN"
    for stat, ratio, error in (("RMS", ERROR_RATIO, rms_error), ("max", MAX_ERROR_RATIO, max_error)):
        ours_err, base_err = error(ours, reference), error(baseline, reference)
        bound = ratio * base_err + EPS[dtype]
        assert ours_err <= bound, f"{name}: {stat} error {ours_err:.3e} > {ratio} x the baseline's {base_err:.3e} + eps"


def ran_with(kernel_name: str, config=None) -> bool:
    """Whether a launch of that kernel ran that config, or any config (None), by autotune's record
    of its choices (cleared by force_config)."""
    from tilegym import autotune

    return any(key[0] == kernel_name and config in (None, chosen[0]) for key, chosen in autotune._chosen.items())


def make_inputs(case: Case, dtype, device="cuda", requires_grad=False, generator=None):
    """Fresh random q, k, v (never zeros)."""
    shapes = [
        (case.batch, case.q_heads, case.seqlen_q, case.head_dim),
        (case.batch, case.kv_heads, case.seqlen_k, case.head_dim),
        (case.batch, case.kv_heads, case.seqlen_k, case.head_dim),
    ]
    tensors = [torch.randn(s, dtype=dtype, device=device, generator=generator) for s in shapes]
    return [t.requires_grad_(requires_grad) for t in tensors]


def reference_run(q, k, v, d_out, causal: bool, kwargs: dict, compute_dtype, d_lse=None):
    """(out, lse, grads) of the float reference in compute_dtype, for a call with the keyword
    arguments kwargs: grads holds dq, dk, dv, then the gradient of each tensor argument that
    requires grad (attn_bias, sinks), in that order. d_lse, when given, is the LSE's gradient."""
    inputs = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    ref_kwargs = dict(kwargs)
    for name in ("attn_bias", "sinks"):
        tensor = kwargs.get(name)
        if tensor is not None:
            ref_kwargs[name] = tensor.detach().to(compute_dtype).requires_grad_(tensor.requires_grad)
            if tensor.requires_grad:
                inputs.append(ref_kwargs[name])
    out, lse = attention_reference(*inputs[:3], is_causal=causal, compute_dtype=compute_dtype, **ref_kwargs)
    outputs, upstream = [out], [d_out.to(compute_dtype)]
    if d_lse is not None:
        outputs.append(lse)
        upstream.append(d_lse.to(compute_dtype))
    return out, lse, torch.autograd.grad(outputs, inputs, upstream)


def capture_training_step(step, leaves):
    """(graph, what step returned in the capture): step, a training step, captured in a CUDA graph
    after two warm-up calls on a side stream (compiles, tunes and builds block masks' lists
    outside the capture), with the leaves' gradients reset first so that the capture allocates
    them (the graph's static gradients)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result
