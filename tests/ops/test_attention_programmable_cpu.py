"""Score and mask functions without a GPU: their fingerprints, the kernel copies keyed by them,
the checks, the block mask's lists, and every ready-made function compiled into the kernels
for sm_90 (ahead of time)."""

import inspect
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import cuda.tile as ct
import pytest
import torch

from tests.ops import sass
from tilegym.ops.attention import aux_gradients, block_mask, configs, launch, programmable, score_functions
from tilegym.ops.attention.caller_functions import CallerFunctions
from tilegym.ops.attention.problem import AttentionProblem
from tilegym.ops.attention.score_mods import ScoreMods
from tilegym.ops.attention.variants import (
    BACKWARD_DKDV,
    BACKWARD_DQ,
    BACKWARD_FUSED,
    BACKWARD_FUSED_GROUPED,
    FORWARD,
    FORWARD_LSE,
    FORWARD_LSE_FIXED_MAX,
    VARIANTS,
)


def _fingerprint(kwargs: dict) -> str:
    return programmable.user_functions(
        kwargs.get("score_mod"), kwargs.get("score_mod_grad"), kwargs.get("aux_grad"), kwargs.get("mask_mod")
    ).fingerprint


def _scaled(factor):
    def scaled(score, b, h, q_idx, kv_idx, aux):
        return score * factor

    return scaled


def test_fingerprint_follows_code_and_constants_not_identity():
    first, second = _scaled(4.0), _scaled(4.0)
    assert first is not second
    assert programmable.fingerprint(first) == programmable.fingerprint(second)
    assert programmable.fingerprint(first) != programmable.fingerprint(_scaled(5.0))
    assert _fingerprint(score_functions.softcap(4.0)) != _fingerprint(score_functions.softcap(8.0))
    assert _fingerprint(score_functions.softcap(4.0)) != _fingerprint(score_functions.softcap(4.0, approximate=False))
    assert _fingerprint(score_functions.sliding_window_with_globals(40, 4)) != _fingerprint(
        score_functions.sliding_window_with_globals(40, 5)
    )

    def plus_one(score, b, h, q_idx, kv_idx, aux):
        return score + 1.0

    def plus_two(score, b, h, q_idx, kv_idx, aux):
        return score + 2.0

    assert programmable.fingerprint(plus_one) != programmable.fingerprint(plus_two)


def test_factories_give_the_same_functions_for_the_same_numbers():
    """So that a loop calling a factory every step reads each fingerprint once, and torch.compile
    traces once."""
    table = torch.zeros(2, 9)
    for make in (
        lambda: score_functions.softcap(4.0),
        lambda: score_functions.relative_position_bias(table, 4),
        lambda: score_functions.sliding_window_with_globals(40, 4),
        lambda: score_functions.prefix_lm(torch.zeros(2, dtype=torch.int32)),
    ):
        first, second = make(), make()
        for role in ("score_mod", "score_mod_grad", "aux_grad", "mask_mod"):
            assert first.get(role) is second.get(role), role
    assert score_functions.softcap(4.0)["score_mod"] is not score_functions.softcap(8.0)["score_mod"]


def test_fingerprint_is_the_same_in_a_new_process():
    code = (
        "from tilegym.ops.attention import programmable, score_functions as sf\n"
        "f = sf.relative_position_bias(__import__('torch').zeros(2, 9), 4)\n"
        "print(programmable.user_functions(f['score_mod'], f['score_mod_grad'], f['aux_grad']).fingerprint)"
    )
    here = _fingerprint(score_functions.relative_position_bias(torch.zeros(2, 9), 4))
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert here == there


def test_fingerprint_refuses_captured_tensors():
    table = torch.zeros(3)

    def reads_table(score, b, h, q_idx, kv_idx, aux):
        return score + table[0]

    with pytest.raises(TypeError, match=r"score_mod 'test_fingerprint_refuses_captured_tensors.<locals>.reads_table'"):
        programmable.user_functions(score_mod=reads_table)


def test_user_functions_checks():
    capped = score_functions.softcap(2.0)
    assert programmable.user_functions() is None
    with pytest.raises(TypeError, match="mask_mod must be a Python function"):
        programmable.user_functions(mask_mod=len)
    with pytest.raises(ValueError, match="aux_grad is given without score_mod"):
        programmable.user_functions(aux_grad=capped["score_mod_grad"])
    functions = programmable.user_functions(**capped)
    assert functions == programmable.user_functions(**score_functions.softcap(2.0))
    key = ScoreMods(user=functions).key()
    assert key.startswith("|score_mod|fn-") and functions.fingerprint[:16] in key
    assert not ScoreMods(user=programmable.user_functions(mask_mod=lambda b, h, i, j, aux: i >= j)).plain_scores


def test_user_kernel_is_one_copy_per_fingerprint():
    kernel = VARIANTS[FORWARD_LSE].kernel
    assert programmable.user_kernel(kernel, None) is kernel
    first = programmable.user_kernel(kernel, programmable.user_functions(**score_functions.softcap(3.0)))
    again = programmable.user_kernel(kernel, programmable.user_functions(**score_functions.softcap(3.0)))
    other = programmable.user_kernel(kernel, programmable.user_functions(**score_functions.softcap(5.0)))
    assert first is again and first is not other and first is not kernel
    functions = programmable.user_functions(**score_functions.softcap(3.0))
    assert functions.fingerprint[:24] in first._pyfunc.__qualname__  # the kernel cache's key
    assert first._pyfunc.__globals__["SCORE_MOD"] is not None and kernel._pyfunc.__globals__["SCORE_MOD"] is None


def test_compile_errors_name_the_functions_and_tell_compiler_faults_apart():
    """naming_errors turns a cuTile error into a UserFunctionError naming the caller's functions;
    one raised by the compiler itself (no line to point at) says it is not located in them."""
    from cuda.tile._exception import CompilerExecutionError, Loc, TileTypeError

    relative = score_functions.relative_position_bias(torch.zeros(2, 9), 4)
    functions = programmable.user_functions(relative["score_mod"], relative["score_mod_grad"], relative["aux_grad"])
    raised = {
        "located": TileTypeError("cannot add a tuple to a tile", Loc.unknown()),
        "compiler": CompilerExecutionError(5, "failed to compile Tile IR program", Loc.unknown(), "-O3", None),
    }
    messages = {}
    for kind, error in raised.items():
        with pytest.raises(programmable.UserFunctionError) as caught:
            with programmable.naming_errors(functions):
                raise error
        messages[kind] = str(caught.value)
        assert "score_mod '_relative_score'" in messages[kind] and "score_functions.py:" in messages[kind]
        assert caught.value.__cause__ is error
    assert "internal error of cuTile's compiler" in messages["compiler"]
    assert "internal error" not in messages["located"]


def test_check_aux():
    q = torch.zeros(1)
    assert programmable.check_aux(None, q, "aux") == ()
    table = torch.zeros(2, 3)
    assert programmable.check_aux(table, q, "aux") == (table,)
    with pytest.raises(TypeError, match=r"aux\[1\] must be a torch.Tensor"):
        programmable.check_aux((table, 2.0), q, "aux")
    with pytest.raises(ValueError, match="at most 4"):
        programmable.check_aux((table,) * 5, q, "aux")
    with pytest.raises(ValueError, match=r"mask_aux\[0\] must have at least one dimension"):
        programmable.check_aux((torch.tensor(3),), q, "mask_aux")
    with pytest.raises(TypeError, match="bool tensor"):
        programmable.check_aux((torch.zeros(3, dtype=torch.bool),), q, "aux")
    empty = torch.zeros(2, 0)
    with pytest.raises(ValueError, match=r"aux\[0\] is empty"):
        programmable.check_aux((empty,), q, "aux")
    assert programmable.check_aux(empty, q, "aux", read=False) == (empty,)


@pytest.mark.parametrize("seqlen_k, table_keys", [(0, 0), (0, 5), (3, 0)], ids=["empty-table", "table", "keys"])
def test_aux_without_keys(seqlen_k, table_keys):
    """A dense call without keys scores nothing and launches nothing: a per-key aux tensor of no
    entries passes (with keys it is refused, before any launch), and the aux gradient of a
    learnable one is zeros of its shape, not missing (torch.autograd.grad would refuse None)."""
    heads, seqlen_q = 2, 4
    key_bias = torch.randn(1, heads, 1, table_keys, dtype=torch.float32)
    given = score_functions.additive_bias(key_bias)
    caller = CallerFunctions.of(given["score_mod"], given["score_mod_grad"], given["aux"], given["aux_grad"],
                                None, None, None)  # fmt: skip
    q = torch.randn(1, heads, seqlen_q, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(1, heads, seqlen_k, 64, dtype=torch.bfloat16) for _ in range(2))
    problem = AttentionProblem(1, heads, heads, seqlen_q, seqlen_k, 64, torch.bfloat16, 0.125, False)
    if seqlen_k > 0:
        with pytest.raises(ValueError, match=r"aux\[0\] is empty"):
            caller.check(q, problem, launch.NO_TENSORS, training=True, wants_aux_grad=True)
        return
    problem, mod_tensors = caller.check(q, problem, launch.NO_TENSORS, training=True, wants_aux_grad=True)
    out, lse = launch.forward(q, k, v, problem, with_lse=True, mod_tensors=mod_tensors)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    grads = launch.backward(torch.randn_like(out), q, k, v, out, lse, problem, mod_tensors=mod_tensors)
    (d_table,) = grads.d_aux
    assert d_table.shape == key_bias.shape and torch.equal(d_table, torch.zeros_like(d_table))


def _same_document(b, h, q_idx, kv_idx, mask_aux):
    return ct.gather(mask_aux[0], q_idx) == ct.gather(mask_aux[1], kv_idx)


@pytest.mark.parametrize(
    "batch, seqlen_q, seqlen_k",
    [(1, 4, 0), (0, 4, 4), (1, 0, 4), (1, 4, 4)],
    ids=["no-keys", "no-batch", "no-rows", "scores"],
)
def test_mask_aux_of_calls_without_scores(batch, seqlen_q, seqlen_k):
    """A mask whose per-query and per-key tables follow the call's lengths: a dense call that
    scores nothing (no keys, no rows, a batch of none) passes its empty tables and runs nothing,
    output zeros, LSE -inf, zero gradients; a call that scores refuses an empty one before any
    launch. create_block_mask takes the same tables for its sizes."""
    heads = 2
    query_docs = torch.randint(0, 3, (seqlen_q,), dtype=torch.int32)
    key_docs = torch.randint(0, 3, (seqlen_k,), dtype=torch.int32)
    q = torch.randn(batch, heads, seqlen_q, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, heads, seqlen_k, 64, dtype=torch.bfloat16) for _ in range(2))
    problem = AttentionProblem(batch, heads, heads, seqlen_q, seqlen_k, 64, torch.bfloat16, 0.125, True)
    mask_aux = (query_docs, key_docs if problem.scores_nothing else key_docs[:0])
    caller = CallerFunctions.of(None, None, None, None, _same_document, mask_aux, None)
    if not problem.scores_nothing:
        with pytest.raises(ValueError, match=r"mask_aux\[1\] is empty"):
            caller.check(q, problem, launch.NO_TENSORS, training=True)
        with pytest.raises(ValueError, match=r"mask_aux\[1\] is empty"):
            block_mask.create_block_mask(_same_document, None, None, seqlen_q, seqlen_k, "cpu", mask_aux)
        return
    made = block_mask.create_block_mask(_same_document, None, None, seqlen_q, seqlen_k, "cpu", mask_aux)
    assert made.shape == (1, 1, seqlen_q, seqlen_k)
    problem, mod_tensors = caller.check(q, problem, launch.NO_TENSORS, training=True)
    assert mod_tensors.block_mask.shape == (batch, heads, seqlen_q, seqlen_k)
    out, lse = launch.forward(q, k, v, problem, with_lse=True, mod_tensors=mod_tensors)
    assert out.shape == q.shape and torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    grads = launch.backward(torch.randn_like(out), q, k, v, out, lse, problem, mod_tensors=mod_tensors)
    for grad, given in zip((grads.dq, grads.dk, grads.dv), (q, k, v), strict=True):
        assert grad.shape == given.shape and torch.equal(grad, torch.zeros_like(grad))


def test_aux_read_wide():
    """The backward's view of aux tensors where aux_grad runs: 16-bit floats as float32 copies
    of the same values, other tensors as they are."""
    half, brain, single, ids = (torch.randn(3, 5).to(dtype) for dtype in (torch.float16, torch.bfloat16,
                                                                         torch.float32, torch.int32))  # fmt: skip
    read = aux_gradients.read_wide((half, brain, single, ids))
    assert [t.dtype for t in read] == [torch.float32, torch.float32, torch.float32, torch.int32]
    assert torch.equal(read[0], half.float()) and torch.equal(read[1], brain.float())
    assert read[2] is single and read[3] is ids


def test_fixed_point_aux_sums():
    """Fixed-point buffers give back their sums to 2^-32, and NaN, never a wrapped number, where
    the magnitudes reach the limit (or went negative by wrapping)."""
    buffer = aux_gradients.buffers((torch.zeros(3, 2),), torch.float32, deterministic=True)[0]
    assert buffer.shape == (2, 3, 2) and buffer.dtype == torch.int64
    shares = torch.tensor([[0.25, -1.5], [3.0e-6, -7.0], [1.0e6, 2.0]], dtype=torch.float64)
    buffer[0] = torch.round(shares * aux_gradients.FIXED_SCALE).long()
    buffer[1] = torch.ceil(shares.abs() * aux_gradients.MAGNITUDE_SCALE).long()
    buffer[1, 2, 1] = int(aux_gradients.MAGNITUDE_LIMIT)
    buffer[1, 1, 1] = -5
    sums = aux_gradients.sums(buffer)
    assert sums.dtype == torch.float32
    expected = shares.float()
    expected[2, 1] = expected[1, 1] = float("nan")
    torch.testing.assert_close(sums, expected, equal_nan=True, rtol=0, atol=2.0**-32)
    float_buffer = aux_gradients.buffers((torch.zeros(3, 2),), torch.float64, deterministic=False)[0]
    assert float_buffer.dtype == torch.float64 and aux_gradients.sums(float_buffer) is float_buffer


def _adds_by_atomics(grad, score, b, h, q_idx, kv_idx, aux, aux_grads):
    ct.atomic_add(aux_grads[0], h, ct.sum(grad))


def _adds_through_a_helper(grad, score, b, h, q_idx, kv_idx, aux, aux_grads):
    _adds_by_atomics(grad, score, b, h, q_idx, kv_idx, aux, aux_grads)


def _adds_repeatably(grad, score, b, h, q_idx, kv_idx, aux, aux_grads):
    score_functions.add_to_aux_grad(aux_grads, 0, (h,), ct.sum(grad))


def test_aux_grad_that_adds_atomically_is_found():
    """Under deterministic algorithms, aux_grad must add through add_to_aux_grad: an atomic add
    of its own, or in a function it calls, is found before any launch."""
    assert aux_gradients.adds_atomically(_adds_by_atomics)
    assert aux_gradients.adds_atomically(_adds_through_a_helper)
    assert not aux_gradients.adds_atomically(_adds_repeatably)
    table_grad = score_functions.relative_position_bias(torch.zeros(2, 9), 4)["aux_grad"]
    assert not aux_gradients.adds_atomically(table_grad)


def test_block_mask_lists_of_kinds():
    """Each row lists its partial tiles, then its full ones, ascending; counts say how many."""
    kinds = torch.tensor([[[[0, 1, 2, 1], [2, 2, 0, 0], [0, 0, 0, 0]]]], dtype=torch.int8)
    lists = block_mask._lists_of(kinds)
    assert lists.counts[0, 0].tolist() == [[2, 1], [0, 2], [0, 0]]
    assert lists.tiles[0, 0, 0, 0, :2].tolist() == [1, 3] and lists.tiles[0, 0, 0, 1, :1].tolist() == [2]
    assert lists.tiles[0, 0, 1, 1, :2].tolist() == [0, 1]
    assert lists.counts.dtype == lists.tiles.dtype == torch.int32


def test_create_block_mask_checks():
    with pytest.raises(TypeError, match="mask_mod must be a Python function"):
        block_mask.create_block_mask("causal", 1, 1, 8, 8, device="cpu")
    with pytest.raises(ValueError, match="Q_LEN must be a positive int"):
        block_mask.create_block_mask(lambda b, h, i, j, a: i >= j, 1, 1, -1, 8, device="cpu")
    mask = block_mask.create_block_mask(lambda b, h, i, j, a: i >= j, None, 4, 8, 8, device="cpu")
    assert mask.shape == (1, 4, 8, 8) and mask.cu_seqlens is None


def test_create_block_mask_for_packed_batches_checks_the_lengths():
    """B counts the sequences; both cumulative lengths, checked as a packed call's are."""
    causal = lambda b, h, i, j, a: i >= j  # noqa: E731
    cu = torch.tensor([0, 5, 9, 9], dtype=torch.int32)
    mask = block_mask.create_block_mask(causal, None, 2, 8, 8, device="cpu", cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert mask.shape == (3, 2, 8, 8) and mask.cu_seqlens.q is cu
    bad = {
        "only-q": ({"cu_seqlens_q": cu}, TypeError, "cu_seqlens_k must be a torch.Tensor"),
        "int64": ({"cu_seqlens_q": cu.long(), "cu_seqlens_k": cu}, TypeError, "cu_seqlens_q must be torch.int32"),
        "2-d": ({"cu_seqlens_q": cu, "cu_seqlens_k": cu[None]}, ValueError, "cu_seqlens_k must be 1-D"),
        "lengths": ({"cu_seqlens_q": cu, "cu_seqlens_k": cu[:3]}, ValueError, "one length"),
    }
    for given, error, message in bad.values():
        with pytest.raises(error, match=message):
            block_mask.create_block_mask(causal, None, 2, 8, 8, device="cpu", **given)
    with pytest.raises(ValueError, match="B must be None or the number of sequences"):
        block_mask.create_block_mask(causal, 2, 2, 8, 8, device="cpu", cu_seqlens_q=cu, cu_seqlens_k=cu)


# Every ready-made function, its aux and mask_aux arrays as the kernels see them, and whether
# it masks (block_sparse).
_READY_MADE = {
    "softcap": (score_functions.softcap(30.0), {}, False),
    "alibi": (score_functions.alibi(torch.zeros(4), 8, 8), {}, False),
    "additive-bias": (
        score_functions.additive_bias(torch.zeros(2, 4, 8, 8)),
        {"Aux0": (ct.float32, 4), "AuxGrad0": (ct.float32, 4)},
        False,
    ),
    "sliding-window": (score_functions.sliding_window(5, 0, 8, 8), {}, True),
    "relative": (
        score_functions.relative_position_bias(torch.zeros(4, 17), 8),
        {"Aux0": (ct.float32, 2), "AuxGrad0": (ct.float32, 2)},
        False,
    ),
    # Under torch.use_deterministic_algorithms: fixed-point sums (aux_gradients.py).
    "relative-repeatable": (
        score_functions.relative_position_bias(torch.zeros(4, 17), 8),
        {"Aux0": (ct.float32, 2), "AuxGrad0": (ct.int64, 3)},
        False,
    ),
    "documents": (
        score_functions.document_mask(torch.zeros(2, 8, dtype=torch.int32)),
        {"MaskAux0": (ct.int32, 2)},
        True,
    ),
    "prefix-lm": (score_functions.prefix_lm(torch.zeros(2, dtype=torch.int32)), {"MaskAux0": (ct.int32, 1)}, True),
    "window-globals": (score_functions.sliding_window_with_globals(64, 4), {}, True),
    "key-padding": (score_functions.key_padding(torch.zeros(2, dtype=torch.int32)), {"MaskAux0": (ct.int32, 1)}, True),
}


@pytest.mark.parametrize("name", list(_READY_MADE))
def test_ready_made_functions_compile_into_every_kernel(name):
    """Each compiles into the forward, dQ and dK/dV kernels at D=64 bf16 for sm_90 on the first
    config of the tables its switches pick (configs.score_tables), and the score functions (which
    every step pays for) keep the matmuls pipelined; a mask alone runs plain attention's forward
    tiles (CTA clusters) and dK/dV tiles, where it spills nothing at D=64 and 128, and the fused
    backward's at D=128; a score function's forward at D=128 runs on CTA clusters too, and one
    declared elementwise (ALiBi, softcap) on the fused backward."""
    if sass.cuobjdump() is None:
        pytest.skip("cuobjdump not installed")
    kwargs, arrays, masks = _READY_MADE[name]
    functions = programmable.user_functions(
        kwargs.get("score_mod"), kwargs.get("score_mod_grad"), kwargs.get("aux_grad"), kwargs.get("mask_mod")
    )
    tables = configs.score_tables(ScoreMods(user=functions).switches)
    launches = [(variant, 64) for variant in (FORWARD_LSE, BACKWARD_DQ, BACKWARD_DKDV)]
    if tables == configs.ScoreTables.MASKS:
        launches += [(FORWARD_LSE, 128), (BACKWARD_DKDV, 128), (BACKWARD_FUSED, 128), (BACKWARD_FUSED_GROUPED, 128)]
    if tables == configs.ScoreTables.FUNCTIONS:
        launches += [(FORWARD, 128), (FORWARD_LSE, 128)]
    if functions.elementwise and functions.aux_grad is None and functions.mask_mod is None:
        launches += [(BACKWARD_FUSED, 64), (BACKWARD_FUSED, 128)]
    launches = [(variant, head_dim, configs.candidates(variant, "sm_90", head_dim, 2, tables)[0])
                for variant, head_dim in launches]  # fmt: skip
    if tables == configs.ScoreTables.FUNCTIONS and not masks:
        # D=64's forwards run every candidate, running max and fixed max, among them four 64x64
        # CTAs per SM (one warpgroup each): the special-function work beside other CTAs' matmuls.
        every = [(variant, 64, config) for variant in (FORWARD_LSE, FORWARD_LSE_FIXED_MAX)
                 for config in configs.candidates(variant, "sm_90", 64, 2, tables)]  # fmt: skip
        launches += [launch for launch in every if launch not in launches]
    with tempfile.TemporaryDirectory() as workdir:
        for variant, head_dim, config in launches:
            path = sass.compile_cubin(variant, ct.bfloat16, head_dim, config, True, "sm_90",
                                      Path(workdir) / f"{variant}.cubin", {"block_sparse": masks}, functions=functions,
                                      arrays=arrays)  # fmt: skip
            text = sass.disassemble(path)
            assert "HGMMA" in text
            assert not sass.matmuls_serialized(text), f"{name}: {variant} waits for each matmul alone"
            # The fused backward may spill with a mask (the document mask: 17 local stores, 28 local
            # loads and stores inside its loops) and still runs faster than two kernels
            # (perf-notes#fused-backward-masks).
            if tables == configs.ScoreTables.MASKS and variant not in (
                BACKWARD_DQ,
                BACKWARD_FUSED,
                BACKWARD_FUSED_GROUPED,
            ):
                assert sass.count_instructions(text, "STL") == 0, f"{name}: {variant} spills at D={head_dim}"
            if functions.elementwise and head_dim == 64 and (variant == BACKWARD_FUSED or config.occupancy == 4):
                assert sass.count_instructions(text, "LDL") + sass.count_instructions(text, "STL") == 0, (
                    f"{name}: {variant} {config} spills at D=64"
                )
            if (variant, head_dim) == (FORWARD, 128):
                assert config.num_ctas == 2, "the first candidate is plain attention's clusters"


@pytest.mark.parametrize(
    ("switches", "causal", "masked"),
    [({"windowed": True}, True, False), ({"block_sparse": True}, False, True),
     ({"block_sparse": True, "varlen": True}, False, True)],
    ids=["window", "block-mask", "packed-block-mask"],
)  # fmt: skip
def test_aux_gradient_dkdv_compiles_where_key_tiles_go_unseen(switches, causal, masked):
    """The dK/dV kernel with a learned relative table compiles for sm_90 (bf16, D=64, its first
    config) beside a window or a block mask, dense and packed: the forms whose programs check
    whether any query sees their key tile and return early (kernels/backward._seen_by_no_query)."""
    if sass.cuobjdump() is None:
        pytest.skip("cuobjdump not installed")
    functions = _relative_table_functions(masked)
    config = configs.candidates(
        BACKWARD_DKDV, "sm_90", 64, 2, configs.score_tables(ScoreMods(user=functions).switches)
    )[0]
    arrays = {"Aux0": (ct.float32, 2), "AuxGrad0": (ct.float32, 2), **({"MaskAux0": (ct.int32, 1)} if masked else {})}
    with tempfile.TemporaryDirectory() as workdir:
        path = sass.compile_cubin(BACKWARD_DKDV, ct.bfloat16, 64, config, causal, "sm_90", Path(workdir) / "dkdv.cubin",
                                  switches, functions=functions, arrays=arrays)  # fmt: skip
        assert "HGMMA" in sass.disassemble(path)


def _relative_table_functions(masked: bool):
    """A learned relative-position table's functions, beside a prefix-LM mask where masked."""
    relative = score_functions.relative_position_bias(torch.zeros(4, 33), 16)
    mask_mod = score_functions.prefix_lm(torch.zeros(1, dtype=torch.int32))["mask_mod"] if masked else None
    return programmable.user_functions(
        relative["score_mod"], relative["score_mod_grad"], relative["aux_grad"], mask_mod
    )  # fmt: skip


@pytest.mark.parametrize(
    ("dtype", "head_dim", "packed", "deterministic"),
    [(ct.float32, 64, True, False), (ct.float64, 64, True, True), (ct.float32, 256, True, True),
     (ct.float64, 256, True, False), (ct.float16, 128, False, False), (ct.bfloat16, 128, True, False),
     (ct.bfloat16, 256, False, True)],
    ids=["fp32-d64-packed", "fp64-d64-packed-deterministic", "fp32-d256-packed-deterministic", "fp64-d256-packed",
         "fp16-d128", "bf16-d128-packed", "bf16-d256-deterministic"],
)  # fmt: skip
def test_masked_aux_gradient_dkdv_compiles_at_every_config(dtype, head_dim, packed, deterministic):
    """The dK/dV kernel with a learned relative table beside a mask compiles for sm_90 at every
    config of its table, dense and packed, 16-bit and wide, its aux gradient in the table's width
    or in deterministic int64 sums. tileiras failed on each nearby way of reading the mask's two
    counts in _seen_by_no_query: two gathers crashed it on packed batches, one summed pair of
    counts on 16-bit inputs at D=80 to 128 and at 256."""
    if sass.cuobjdump() is None:
        pytest.skip("cuobjdump not installed")
    functions = _relative_table_functions(masked=True)
    element_size = {ct.float32: 4, ct.float64: 8}.get(dtype, 2)
    wide = ct.float64 if dtype == ct.float64 else ct.float32
    tables = configs.score_tables(ScoreMods(user=functions).switches)
    aux_grad = (ct.int64, 3) if deterministic else (wide, 2)
    arrays = {"Aux0": (wide, 2), "AuxGrad0": aux_grad, "MaskAux0": (ct.int32, 1)}
    switches = {"block_sparse": True, **({"varlen": True} if packed else {})}
    for config in configs.candidates(BACKWARD_DKDV, "sm_90", head_dim, element_size, tables):
        with tempfile.TemporaryDirectory() as workdir:
            path = sass.compile_cubin(BACKWARD_DKDV, dtype, head_dim, config, False, "sm_90",
                                      Path(workdir) / "dkdv.cubin", switches, functions=functions,
                                      arrays=arrays)  # fmt: skip
            text = sass.disassemble(path)
            atomics = sum(sass.count_instructions(text, opcode) for opcode in ("RED", "ATOM", "ATOMG"))
            assert atomics > 0, f"{config}: no atomic adds, so no aux gradient compiled in"


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backward_compiled_ahead_as_launched_with_an_aux_gradient(monkeypatch, table_dtype):
    """With a score function whose table takes a gradient, compile_backward_ahead starts the very
    kernels (the copies with the functions) and argument layouts the backward launches, the aux
    gradients' buffers included; and the launched dK/dV kernel writes into a buffer of the
    table's shape, zeroed right before it. Both read a 16-bit table as a float32 copy
    (aux_gradients.read_wide)."""
    import collections

    from tests.ops.test_attention_cpu import _layout, _RecordingLauncher
    from tilegym.ops.attention import launch
    from tilegym.ops.attention import problem as problem_mod
    from tilegym.ops.attention.score_mods import ModTensors

    monkeypatch.setattr(launch, "_Launcher", _RecordingLauncher)
    monkeypatch.setattr(launch, "_compiled_ahead", collections.OrderedDict())
    _RecordingLauncher.launches, _RecordingLauncher.compiled_ahead = [], []
    q, k, v = (torch.randn(1, heads, 40, 64, dtype=torch.bfloat16) for heads in (4, 2, 2))
    table = torch.randn(4, 17, dtype=table_dtype)
    relative = score_functions.relative_position_bias(table, 8)
    functions = programmable.user_functions(relative["score_mod"], relative["score_mod_grad"], relative["aux_grad"])
    problem = problem_mod.AttentionProblem(1, 4, 2, 40, 40, 64, torch.bfloat16, 0.125, True, ScoreMods(user=functions))
    tensors = ModTensors(aux=(table,))
    launch.compile_backward_ahead(q, k, v, problem, tensors)
    out, lse = torch.randn(1, 4, 40, 64, dtype=torch.bfloat16), torch.randn(1, 4, 40)
    gradients = launch.backward(torch.randn_like(out), q, k, v, out, lse, problem, mod_tensors=tensors)

    ahead, launched = _RecordingLauncher.compiled_ahead, _RecordingLauncher.launches
    assert [name for name, *_ in launched] == [BACKWARD_DQ, BACKWARD_DKDV]
    for (name, kernel, grid, args, _), (_, made_kernel, made_grid, made_args, _) in zip(ahead, launched, strict=True):
        assert kernel is made_kernel and functions.fingerprint[:24] in kernel._pyfunc.__qualname__, name
        assert grid == made_grid and [_layout(a) for a in args] == [_layout(a) for a in made_args], name
        aux = args[list(inspect.signature(kernel._pyfunc).parameters).index("Aux0")]
        assert aux.dtype == torch.float32 and torch.equal(aux, table.float()), name
    assert gradients.d_aux[0].shape == table.shape
    assert torch.equal(gradients.d_aux[0], torch.zeros(table.shape))


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("name", [name for name, (_, _, masks) in _READY_MADE.items() if masks])
def test_ready_made_masks_compile_into_the_sorting_kernel(name, varlen):
    """The kernel that sorts a block mask's tiles compiles with each ready-made mask for sm_90,
    dense and packed."""
    from cuda.tile.compilation import CallingConvention, KernelSignature, ScalarConstraint, export_kernel

    from tilegym.ops.attention.kernels.block_mask import block_mask_kernel

    kwargs, arrays, _ = _READY_MADE[name]
    kernel = programmable.user_kernel(block_mask_kernel, programmable.user_functions(mask_mod=kwargs["mask_mod"]))
    aux = [sass.array_constraint(*arrays.get(f"MaskAux{slot}", (ct.float32, 1))) for slot in range(4)]
    lengths = [sass.array_constraint(ct.int32, 1)] * 2
    sizes = [ScalarConstraint(ct.int32)] * 6
    parameters = [sass.array_constraint(ct.int8, 4), *aux, *lengths, *sizes, 128, 64, True, False, varlen]
    signature = KernelSignature(parameters, CallingConvention.cutile_python_v2()).with_mangled_symbol("sort_tiles")
    with tempfile.TemporaryDirectory() as workdir:
        export_kernel(kernel, [signature], str(Path(workdir) / "k.cubin"), gpu_code="sm_90", output_format="cubin")


def test_faulty_dq_config_left_out_of_its_calls_only():
    """float16 at D=192 with softcap= beside a score function never tries the dQ config seen to
    compute wrong gradients there (configs.FAULTY_CONFIGS); the table's other configs stay, and
    bfloat16, D=256, softcap alone and the function alone keep the whole table, in its order."""
    bias = score_functions.additive_bias(torch.zeros(1, 1, 1, 1))
    function = programmable.user_functions(bias["score_mod"], bias["score_mod_grad"])
    (faulty,) = configs.FAULTY_CONFIGS

    def candidates(dtype=torch.float16, dim=192, softcap=5.0, user=function):
        mods = ScoreMods(softcap=softcap, user=user, window=(300, 0))
        problem = AttentionProblem(1, 2, 2, 100, 100, dim, dtype, 0.1, True, mods)
        table = configs.candidates(BACKWARD_DQ, "sm_90", dim, 2, configs.score_tables(mods.switches))
        launcher = types.SimpleNamespace(arch="sm_90", problem=problem)  # all _Launcher.candidates reads
        return launch._Launcher.candidates(launcher, BACKWARD_DQ), table

    chosen, table = candidates()
    assert faulty.config in table and faulty.config not in chosen
    assert chosen == tuple(config for config in table if config != faulty.config) and chosen
    for kept in (candidates(torch.bfloat16), candidates(dim=256), candidates(user=None), candidates(softcap=0.0)):
        assert kept[0] == kept[1]


def test_faulty_configs_name_configs_of_their_tables():
    """Each FAULTY_CONFIGS entry leaves out a config its kernel's table holds for those switches,
    and leaves that table at least one other."""
    for entry in configs.FAULTY_CONFIGS:
        table = configs.candidates(entry.kernel, "sm_90", entry.head_dim, 2, configs.score_tables(entry.switches))
        dtype = getattr(torch, entry.dtype)
        kept = configs.call_candidates(entry.kernel, "sm_90", entry.head_dim, entry.head_dim, dtype, entry.switches)
        assert entry.config in table and entry.config not in kept and kept, entry
