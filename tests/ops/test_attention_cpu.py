"""Attention checks that need no GPU: config tables, validation, index widths, launch arguments, reference."""

import collections
import dataclasses
import math
import subprocess
import sys

import cuda.tile as ct
import pytest
import torch

from tilegym import autotune, index_width, launching, tile_fmha, tile_fmha_functional, tile_fmha_with_backward
from tilegym.ops.attention import configs, dispatch, launch, packing, programmable, score_functions, score_mods
from tilegym.ops.attention import problem as problem_mod
from tilegym.ops.attention.reference import attention_naive, attention_reference, causal_mask
from tilegym.ops.attention.score_mods import ScoreMods
from tilegym.ops.attention.variants import VARIANTS


def test_op_import_touches_no_gpu():
    code = "import sys, tilegym, tilegym.ops; assert 'cuda.tile' not in sys.modules, 'cuda.tile imported'; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


# ---- config tables -------------------------------------------------------------------------


@pytest.mark.parametrize("arch", configs.ARCHS)
@pytest.mark.parametrize("kernel", configs.KERNELS)
def test_op_config_tables_cover_every_head_dim(arch, kernel):
    for element_size in (2, 4, 8):
        for head_dim in configs.HEAD_DIMS:
            table = configs.candidates(kernel, arch, head_dim, element_size)
            assert table, f"no config for {kernel} on {arch} at d={head_dim}"
            assert len(set(table)) == len(table), "duplicate configs waste tuning time"
            for config in table:
                assert config.block_m >= 1 and config.block_m & (config.block_m - 1) == 0
                if kernel == configs.BACKWARD_PREPROCESS:
                    assert config.block_n is None
                else:
                    assert config.block_n >= 1 and config.block_n & (config.block_n - 1) == 0
                assert config.num_worker_warps in (None, 4, 8)
                assert config.num_ctas in (None, 1, 2, 4)
                assert config.occupancy is None or 1 <= config.occupancy <= 32


def test_op_config_tables_stay_small():
    """Tuning a new shape must stay quick: at most four candidates a kernel."""
    for arch in configs.ARCHS:
        for kernel in configs.KERNELS:
            for head_dim in configs.HEAD_DIMS:
                assert len(configs.candidates(kernel, arch, head_dim, 2)) <= 4


def test_op_training_forward_tunes_like_inference_forward():
    for arch in configs.ARCHS:
        for head_dim in configs.HEAD_DIMS:
            assert configs.candidates(configs.FORWARD, arch, head_dim, 2) == configs.candidates(
                configs.FORWARD_LSE, arch, head_dim, 2
            )


def test_op_modified_configs_run_on_single_ctas():
    """Score modifiers never run on CTA clusters (a two-CTA forward faulted with a one-row bias)."""
    for arch in configs.ARCHS:
        for kernel in configs.KERNELS:
            for head_dim in configs.HEAD_DIMS:
                table = configs.candidates(kernel, arch, head_dim, 2, configs.ScoreTables.MODIFIED)
                assert table, f"no config for {kernel} on {arch} at d={head_dim} with modifiers"
                assert all((config.num_ctas or 1) == 1 for config in table)
                own_tables = (
                    configs.ScoreTables.ALIBI,
                    configs.ScoreTables.MASKS,
                    configs.ScoreTables.FUNCTIONS,
                    configs.ScoreTables.SOFTCAP,
                    configs.ScoreTables.WINDOW,
                )
                for own in own_tables:
                    assert configs.candidates(kernel, arch, head_dim, 2, own), (kernel, arch, own)


def test_op_score_tables_follow_the_switches():
    """ALiBi alone, a mask function alone, a score function, softcap alone and a window alone
    pick their own tables; anything else the modified ones."""
    assert configs.score_tables(frozenset()) == configs.ScoreTables.PLAIN
    assert configs.score_tables(frozenset({"alibi"})) == configs.ScoreTables.ALIBI
    assert configs.score_tables(frozenset({"masks"})) == configs.ScoreTables.MASKS
    for functions in ({"functions"}, {"functions", "masks"}):
        assert configs.score_tables(frozenset(functions)) == configs.ScoreTables.FUNCTIONS
    assert configs.score_tables(frozenset({"capped"})) == configs.ScoreTables.SOFTCAP
    assert configs.score_tables(frozenset({"windowed"})) == configs.ScoreTables.WINDOW
    for other in (
        {"alibi", "windowed"},
        {"capped", "alibi"},
        {"functions", "alibi"},
        {"masks", "capped"},
    ):
        assert configs.score_tables(frozenset(other)) == configs.ScoreTables.MODIFIED


@pytest.mark.parametrize("head_dim, tile", [(32, 32), (64, 64), (80, 128), (96, 128), (128, 128), (256, 256)], ids=str)
def test_op_head_dim_tile(head_dim, tile):
    assert configs.head_dim_tile(head_dim) == tile


@pytest.mark.parametrize(
    "head_dim, tiles", [(64, (64, 0)), (80, (128, 0)), (96, (64, 32)), (192, (128, 64)), (256, (256, 0))], ids=str
)
def test_op_head_dim_tiles(head_dim, tiles):
    """192 runs as a 128-wide tile and a 64-wide tail, 96 as 64 + 32; the tail starts at a whole number of its
    own tiles (kernels/head.py indexes it so), and the two cover the head dim exactly."""
    block_d, tail = configs.head_dim_tiles(head_dim)
    assert (block_d, tail) == tiles
    if tail:
        assert block_d % tail == 0 and block_d + tail == head_dim
    for split, (main, rest) in configs.SPLIT_HEAD_DIMS.items():
        assert split in configs.HEAD_DIMS and main % rest == 0 and main + rest == split


@pytest.mark.parametrize(
    "capability, arch",
    [((8, 0), "sm_80"), ((8, 9), "sm_80"), ((9, 0), "sm_90"), ((10, 0), "sm_100"), ((12, 0), "sm_120")],
)
def test_op_arch_family(capability, arch):
    assert launching.arch_family(capability) == arch


# ---- validation ---------------------------------------------------------------------------


def _cpu_inputs(q_shape=(1, 4, 16, 64), kv_shape=(1, 2, 16, 64), dtype=torch.bfloat16):
    return torch.randn(q_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype)


@pytest.mark.parametrize("api", [tile_fmha, tile_fmha_with_backward, tile_fmha_functional])
@pytest.mark.parametrize(
    "mutate, error, message",
    [
        (lambda q, k, v: ([1.0], k, v), TypeError, "q must be a torch.Tensor"),
        (lambda q, k, v: (q[0], k, v), ValueError, "q must have 4 dimensions"),
        (lambda q, k, v: (q, k.int(), v), TypeError, "k has dtype torch.int32"),
        (lambda q, k, v: (q, k.half(), v), TypeError, "share one dtype"),
        (lambda q, k, v: (q, k, v[:, :, :8]), ValueError, "same batch, heads and length"),
        (lambda q, k, v: (q, torch.cat([k, k]), torch.cat([v, v])), ValueError, "batch size"),
        (lambda q, k, v: (q[..., :32], k, v), ValueError, "head dim of q"),
        (lambda q, k, v: (q[..., :48], k[..., :48], v[..., :48]), ValueError, "head dim 48 is not supported"),
        (lambda q, k, v: (q, k, v[..., :48]), ValueError, "v's head dim 48 is not supported"),
        (lambda q, k, v: (q[:, :3], k, v), ValueError, "multiple of"),
        (lambda q, k, v: (q, k, v), ValueError, "q must be a CUDA tensor"),
    ],
    ids=[
        "not-tensor",
        "rank",
        "int-dtype",
        "mixed-dtype",
        "k-v-shape",
        "batch",
        "head-dim",
        "bad-head-dim",
        "bad-value-head-dim",
        "gqa",
        "cpu",
    ],
)
def test_op_attention_rejects_bad_input(api, mutate, error, message):
    q, k, v = mutate(*_cpu_inputs())
    with pytest.raises(error, match=message):
        api(q, k, v)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"scaling": "0.1"}, TypeError, "scaling must be a float"),
        ({"scaling": True}, TypeError, "scaling must be a float"),
        ({"scaling": math.nan}, ValueError, "scaling must be finite"),
        ({"scaling": 1e300}, ValueError, "float32 range"),
        ({"scaling": 10**400}, ValueError, "scaling must be finite and within the float32 range"),
        ({"scaling": -(10**400)}, ValueError, "scaling must be finite and within the float32 range"),
        ({"is_causal": 1}, TypeError, "is_causal must be a bool"),
    ],
    ids=[
        "str-scale",
        "bool-scale",
        "nan-scale",
        "huge-scale",
        "int-beyond-float",
        "negative-int-beyond-float",
        "int-causal",
    ],
)
def test_op_attention_rejects_bad_options(kwargs, error, message):
    with pytest.raises(error, match=message):
        tile_fmha(*_cpu_inputs(), **kwargs)


def test_op_attention_rejects_huge_grid():
    q, k, v = (torch.empty((70000, 1, 1, 64), dtype=torch.float16) for _ in range(3))
    with pytest.raises(ValueError, match="at most 65535"):
        tile_fmha(q, k, v)


class _CountingChecks:
    """Stands in for problem_mod._check_all_inputs: counts the full checks, and fails the call when
    told to (as the real checks do for bad input)."""

    def __init__(self):
        self.calls = 0
        self.reject = False

    def __call__(self, q, k, v, scaling, is_causal, *mods):
        self.calls += 1
        if self.reject:
            raise ValueError("rejected")
        batch, heads, seqlen, head_dim = q.shape
        problem = problem_mod.AttentionProblem(batch, heads, heads, seqlen, seqlen, head_dim, q.dtype, 0.125, is_causal)
        return problem, score_mods.ModTensors()


class _FloatSubclass(float):
    pass


def test_op_calls_are_checked_in_full_once(monkeypatch):
    """A call without attn_bias whose tensors' shapes, dtypes and devices, scaling, mask and
    modifiers (the window's sides, softcap, the slopes' and the sinks' shape, dtype and device)
    were checked before takes the checked problem, with this call's slopes and sinks; any
    difference is checked in full once; a bias, a value that is not a plain float, int, bool or
    tensor (a Parameter for the sinks and slopes), or a call that failed its checks goes through
    every check."""
    checks = _CountingChecks()
    monkeypatch.setattr(problem_mod, "_check_all_inputs", checks)
    monkeypatch.setattr(problem_mod, "_checked_calls", problem_mod.CheckedCalls())
    q, k, v = _cpu_inputs(kv_shape=(1, 4, 16, 64))
    first, _ = problem_mod.check_inputs(q, k, v, None, True)
    again, mod_tensors = problem_mod.check_inputs(torch.randn_like(q), k.clone(), v.clone(), None, True)
    assert checks.calls == 1 and again is first and mod_tensors == score_mods.NO_TENSORS
    sinks, slopes = torch.randn(4, dtype=torch.bfloat16), torch.rand(4)
    known_after_once = (
        lambda: problem_mod.check_inputs(q, k, v, None, False),
        lambda: problem_mod.check_inputs(q, k, v, 0.5, True),
        lambda: problem_mod.check_inputs(q.half(), k, v, None, True),
        lambda: problem_mod.check_inputs(q[:, :, :8], k, v, None, True),
        lambda: problem_mod.check_inputs(q, k, v, None, True, softcap=30.0),
        lambda: problem_mod.check_inputs(q, k, v, None, True, window_size=(4, 0)),
        lambda: problem_mod.check_inputs(q, k, v, None, True, window_size=(5, 0)),
        lambda: problem_mod.check_inputs(q, k, v, None, True, sinks=sinks),
        lambda: problem_mod.check_inputs(q, k, v, None, True, sinks=sinks.float()),
        lambda: problem_mod.check_inputs(q, k, v, None, True, alibi_slopes=slopes),
        lambda: problem_mod.check_inputs(q, k, v, None, True, alibi_slopes=slopes[None]),
    )
    checked_every_time = (
        lambda: problem_mod.check_inputs(q, k, v, 1, True),  # an int scaling
        lambda: problem_mod.check_inputs(torch.nn.Parameter(q), k, v, None, True),
        lambda: problem_mod.check_inputs(q, k, v, None, True, attn_bias=torch.randn(16, 16)),
        lambda: problem_mod.check_inputs(q, k, v, None, True, softcap=_FloatSubclass(30.0)),
        lambda: problem_mod.check_inputs(q, k, v, None, True, window_size=(4.0, 0)),
    )
    for expected, group in ((1, known_after_once), (2, checked_every_time)):
        for call in group:
            before = checks.calls
            call()
            call()
            assert checks.calls == before + expected
    # A window as a list is the same pair; the sinks as a Parameter the same tensor.
    before = checks.calls
    problem_mod.check_inputs(q, k, v, None, True, window_size=[4, 0])
    problem_mod.check_inputs(q, k, v, None, True, sinks=torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16)))
    assert checks.calls == before
    checks.reject = True
    for _ in range(2):
        with pytest.raises(ValueError, match="rejected"):
            problem_mod.check_inputs(q, k, v, None, True, window_size=(6, 0))
        with pytest.raises(ValueError, match="rejected"):
            problem_mod.check_inputs(q, k[:, :2], v[:, :2], None, True)
    assert problem_mod.check_inputs(q, k, v, None, True)[0] is first  # still known


def test_op_known_calls_take_their_own_sinks_and_slopes(monkeypatch):
    """A call that takes a checked problem gets its own sinks and slopes as the kernels take them
    (the full checks' views), not those of the call checked first."""
    monkeypatch.setattr(problem_mod, "_checked_calls", problem_mod.CheckedCalls())
    q, k, v = _cpu_inputs(kv_shape=(1, 4, 16, 64))
    batch, heads, seqlen, head_dim = q.shape
    problem = problem_mod.AttentionProblem(batch, heads, 4, seqlen, seqlen, head_dim, q.dtype, 0.125, True)

    def full_checks(q, k, v, scaling, is_causal, attn_bias, window_size, softcap, alibi_slopes, bias_grad, sinks):
        views = score_mods.check_alibi(alibi_slopes, q, heads), score_mods.check_sinks(sinks, q, heads)
        return problem, score_mods.ModTensors(None, *views)

    monkeypatch.setattr(problem_mod, "_check_all_inputs", full_checks)
    for sinks_dtype in (torch.bfloat16, torch.float32):
        problem_mod.check_inputs(
            q, k, v, None, True, sinks=torch.randn(heads, dtype=sinks_dtype), alibi_slopes=torch.rand(heads)
        )
    monkeypatch.setattr(problem_mod, "_check_all_inputs", None)  # a full check would fail now
    for sinks_dtype in (torch.bfloat16, torch.float32):
        sinks, slopes = torch.randn(heads, dtype=sinks_dtype), torch.rand(1, heads).view(heads)
        known, mod_tensors = problem_mod.check_inputs(q, k, v, None, True, sinks=sinks, alibi_slopes=slopes)
        expected = full_checks(q, k, v, None, True, None, None, None, slopes, None, sinks)[1]
        assert known is problem and mod_tensors.bias is None
        for got, want in ((mod_tensors.sinks, expected.sinks), (mod_tensors.slopes, expected.slopes)):
            assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
            assert torch.equal(got, want)


def test_op_call_memo_is_bounded(monkeypatch):
    monkeypatch.setattr(problem_mod, "_check_all_inputs", _CountingChecks())
    monkeypatch.setattr(problem_mod, "_checked_calls", problem_mod.CheckedCalls())
    q, k, v = _cpu_inputs(kv_shape=(1, 4, 16, 64))
    for i in range(problem_mod.CheckedCalls.MAX + 5):
        problem_mod.check_inputs(q, k, v, 1.0 + i, True)
    assert len(problem_mod._checked_calls) <= problem_mod.CheckedCalls.MAX


def test_op_split_float_is_exact_to_fp64_rounding():
    for x in (1 / math.sqrt(80) * problem_mod.LOG2E, 0.125, -0.3, 1e-6):
        hi, lo = launching.split_float(x)
        assert abs((hi + lo) - x) <= 1e-14 * abs(x)


def test_op_shape_key_rounds_sequence_lengths():
    problem = problem_mod.AttentionProblem(2, 8, 2, 1000, 1025, 128, torch.bfloat16, 0.1, True)
    assert problem.shape_key("sm_90") == "sm_90|bfloat16|d128|g4|causal|sq1024|sk2048"


def test_op_problem_keeps_its_hash_but_not_across_pickling():
    """Memos find a call's problem by its hash: kept once computed, equal for equal problems, the
    hash of its fields, and found again (not carried) by a pickled copy."""
    import pickle

    mods = ScoreMods(window=(64, 0), softcap=30.0)
    make = lambda: problem_mod.AttentionProblem(2, 8, 2, 1000, 1025, 128, torch.bfloat16, 0.1, True, mods)  # noqa: E731
    problem, twin = make(), make()
    fields = tuple(getattr(problem, field.name) for field in dataclasses.fields(problem))
    assert hash(problem) == hash(twin) == hash(fields)
    assert problem.__dict__["_hash"] == hash(fields)
    copy = pickle.loads(pickle.dumps(problem))
    assert "_hash" not in copy.__dict__ and copy == problem and hash(copy) == hash(problem)
    other = dataclasses.replace(problem, causal=False)
    assert other != problem and hash(other) == hash((*fields[:8], False, *fields[9:]))


def test_op_forced_configs_win_over_a_problems_table():
    """force_config decides a launcher's config lists while it holds, the tables before and after."""
    problem = problem_mod.AttentionProblem(2, 8, 8, 4096, 4096, 128, torch.bfloat16, 0.1, True)
    launcher = _RecordingLauncher(problem, torch.device("cpu"))
    table = configs.candidates(launch.BACKWARD_DQ, "sm_90", 128, 2)
    assert launcher.candidates(launch.BACKWARD_DQ) == table
    forced = autotune.TileConfig(block_m=64, block_n=32)
    with autotune.force_config(launch.BACKWARD_DQ, forced):
        assert launcher.candidates(launch.BACKWARD_DQ) == (forced,)
    assert launcher.candidates(launch.BACKWARD_DQ) == table


# ---- reference ----------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape", [(1, 2, 2, 5, 7, 8), (2, 4, 2, 9, 4, 16), (1, 3, 1, 1, 1, 8), (1, 2, 1, 6, 2, 8)], ids=str
)
def test_op_reference_matches_naive(shape, causal):
    batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim = shape
    generator = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(batch, q_heads, seqlen_q, head_dim, generator=generator)
    k = torch.randn(batch, kv_heads, seqlen_k, head_dim, generator=generator)
    v = torch.randn(batch, kv_heads, seqlen_k, head_dim, generator=generator)
    out, lse = attention_reference(q, k, v, scaling=0.7, is_causal=causal)
    naive_out, naive_lse = attention_naive(q, k, v, scaling=0.7, is_causal=causal)
    torch.testing.assert_close(out, naive_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, naive_lse, rtol=1e-12, atol=1e-12)


def test_op_reference_gradients_finite_for_rows_without_keys():
    q, k, v = (torch.randn(1, 1, n, 8, dtype=torch.float64, requires_grad=True) for n in (6, 2, 2))
    out, lse = attention_reference(q, k, v, is_causal=True)
    assert torch.isinf(lse[0, 0, :4]).all() and torch.isfinite(lse[0, 0, 4:]).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(q.grad[0, 0, :4], torch.zeros(4, 8, dtype=torch.float64))


# ---- launch arguments -------------------------------------------------------------------------


class _RecordingLauncher:
    """Stands in for launch._Launcher on the CPU: records each launch instead of running it."""

    launches: list = []
    compiled_ahead: list = []

    def __init__(self, problem, device, block_mask=None):
        self.arch = "sm_90"
        self.problem = problem
        self.block_mask = block_mask
        self.device = device

    candidates = launch._Launcher.candidates
    tuned = launch._Launcher.tuned

    def launch(self, launch):
        if launch.reset is not None:
            launch.reset()
        self.launches.append(self._record(launch))

    def compile_ahead(self, launch):
        self.compiled_ahead.append(self._record(launch))

    def _record(self, launch):
        config = self.candidates(launch.name)[0]
        return launch.name, launch.kernel, launch.grid(config), launch.args(config), config


@pytest.mark.parametrize("batch", [1, 3], ids=["batch1", "batch3"])
def test_op_launch_arguments_match_kernel_parameters(monkeypatch, batch):
    """Every argument tuple has one value per kernel parameter, each array in its place."""
    import inspect

    monkeypatch.setattr(launch, "_Launcher", _RecordingLauncher)
    _RecordingLauncher.launches = []
    q, k, v = _cpu_inputs(q_shape=(batch, 4, 40, 64), kv_shape=(batch, 2, 24, 64))
    problem = problem_mod.AttentionProblem(batch, 4, 2, 40, 24, 64, torch.bfloat16, 0.125, True)
    out, lse = launch.forward(q, k, v, problem, with_lse=True)
    inference_out, _ = launch.forward(q, k, v, problem, with_lse=False)
    d_out = torch.randn_like(q)
    gradients = launch.backward(d_out, q, k, v, out, lse, problem)
    dq, dk, dv = gradients.dq, gradients.dk, gradients.dv

    arrays = {"Q": q, "K": k, "V": v, "Out": out, "Lse": lse, "dOut": d_out, "dQ": dq, "dK": dk, "dV": dv}
    launched = [name for name, *_ in _RecordingLauncher.launches]
    assert launched == [configs.FORWARD_LSE, configs.FORWARD, configs.BACKWARD_DQ, configs.BACKWARD_DKDV]
    values_of = {}
    for name, kernel, grid, args, config in _RecordingLauncher.launches:
        parameters = list(inspect.signature(kernel._pyfunc).parameters)
        assert len(args) == len(parameters), name
        values = values_of[name] = dict(zip(parameters, args, strict=True))
        expected = arrays
        if name == configs.FORWARD:  # the inference forward writes no LSE: its Lse is a placeholder
            expected = {key: value for key, value in arrays.items() if key != "Lse"} | {"Out": inference_out}
            assert values["write_lse"] is False and values["Lse"].data_ptr() != lse.data_ptr()
        for parameter, value in values.items():
            if parameter in expected:
                assert value.data_ptr() == expected[parameter].data_ptr(), f"{name}: {parameter}"
                assert value.numel() == expected[parameter].numel(), f"{name}: {parameter}"
        assert values["block_m"] == config.block_m and values.get("block_n", config.block_n) == config.block_n
        assert values.get("causal", True) is True and values.get("query_group_size", 2) == 2
        heads = 2 if name == configs.BACKWARD_DKDV else 4
        assert grid[1:] == (heads, batch), name  # the kernels index (head, batch) from the grid
    # The dK/dV kernel reads the row statistics the dQ kernel wrote.
    for stat in ("Delta", "LseBase2"):
        written, read = values_of[configs.BACKWARD_DQ][stat], values_of[configs.BACKWARD_DKDV][stat]
        assert written.data_ptr() == read.data_ptr() and written.shape == read.shape == (batch, 4, 40), stat


# ---- index widths ------------------------------------------------------------------------------


def test_op_index_ranges_refuse_what_int32_positions_cannot_hold():
    """The largest sizes the kernels' int32 position arithmetic holds pass, one more is refused."""
    problem_mod._check_index_ranges(1, 2**28, 2**28)
    problem_mod._check_index_ranges(7, 2**28, 2**28 // 7 - 2**28 // 7 % 2)
    with pytest.raises(ValueError, match="seqlen_q \\+ seqlen_k is 536870913"):
        problem_mod._check_index_ranges(1, 2**28, 2**28 + 1)
    with pytest.raises(ValueError, match="heads \\* \\(seqlen_q \\+ seqlen_k\\)"):
        problem_mod._check_index_ranges(65535, 2**15, 2**15)


@pytest.mark.parametrize(
    "shape, stride, offset, wide",
    [
        ((4, 32, 131072, 128), None, 0, False),  # 2**31 elements, strides in int32, bulk copies
        ((4, 32, 131072, 128), None, 1, True),  # the same one element off alignment
        ((4, 32, 131072, 127), (32 * 131072 * 127, 131072 * 127, 127, 1), 0, True),  # odd row stride
        ((2, 16, 1024, 128), None, 1, False),  # misaligned but within 2**31 bytes
        ((1, 16, 1048653, 128), None, 0, True),  # the batch stride passes int32
        ((2, 8, 16, 64), (2**31, 1024, 64, 1), 0, True),  # a view into a larger tensor
        ((2**31, 1, 1, 1), None, 0, True),
    ],
)
def test_op_needs_int64_reads_sizes_strides_and_alignment(shape, stride, offset, wide):
    """Sizes or strides past int32 need int64 indexing; so do more than 2**31 bytes that bulk
    copies cannot move (a misaligned base or stride), whose 32-bit offsets wrapped on an H100."""
    stride = stride or torch.empty(shape, device="meta").stride()
    t = torch.empty_strided(shape, stride, dtype=torch.bfloat16, device="meta")
    if offset:
        t = torch.empty(1, dtype=torch.bfloat16, device="meta").as_strided(shape, stride, offset)
        t = _MisalignedView(t)
    assert index_width.needs_int64(t) is wide


class _MisalignedView:
    """A meta tensor's sizes and strides with an odd address (meta tensors all read as 0)."""

    def __init__(self, t):
        self.shape, self._t = t.shape, t

    def stride(self, dim=None):
        return self._t.stride() if dim is None else self._t.stride(dim)

    def dim(self):
        return self._t.dim()

    def numel(self):
        return self._t.numel()

    def element_size(self):
        return self._t.element_size()

    def data_ptr(self):
        return 2


@pytest.mark.parametrize(
    "sizes, bias_rows, wide",
    [
        ((4, 32, 32, 131072, 131072, 128), None, False),
        ((1, 16, 16, 1048653, 200, 128), None, True),  # out's batch stride passes int32
        ((1, 4, 4, 16384, 16384, 64), 16384, False),  # a full dBias past 2**31 bytes, aligned rows
        ((1, 4, 4, 16383, 16383, 64), 16383, True),  # the same with odd rows
        ((1, 16, 16, 16384, 16384, 64), 16384, True),  # its batch stride passes int32
        ((2, 16, 16, 16384, 16384, 64), 1, False),
    ],
)
def test_op_allocations_checked_for_int64_indexing(sizes, bias_rows, wide):
    bias_size = 0 if bias_rows is None else 4
    mode = score_mods.BIAS_ONE_ROW if bias_rows == 1 else score_mods.BIAS_PER_ROW
    head_dim = sizes[-1]
    assert problem_mod._allocations_need_int64(*sizes, head_dim, 2, bias_size, mode) is wide


def test_op_allocations_checked_with_the_wider_value_head_dim():
    """An output [B, Hq, Sq, Dv] wider than q can pass int32 where q does not."""
    sizes = (1, 16, 16, 1048000, 200)
    assert not problem_mod._allocations_need_int64(*sizes, 64, 64, 2, 0, 0)
    assert problem_mod._allocations_need_int64(*sizes, 64, 256, 2, 0, 0)


def test_op_wide_problems_launch_int64_indexed_twins(monkeypatch):
    """A problem with a size or stride past int32 launches every kernel's int64-indexed twin,
    whose array parameters are all annotated, under a tuning key of its own; others the kernels
    themselves. A d_out with such a stride widens the backward alone."""
    import cuda.tile as ct

    monkeypatch.setattr(launch, "_Launcher", _RecordingLauncher)
    q, k, v = _cpu_inputs(q_shape=(2, 4, 40, 64), kv_shape=(2, 2, 24, 64))
    narrow = problem_mod.AttentionProblem(2, 4, 2, 40, 24, 64, torch.bfloat16, 0.125, True)
    for problem, wide in ((narrow, False), (dataclasses.replace(narrow, wide_index=True), True)):
        _RecordingLauncher.launches = []
        out, lse = launch.forward(q, k, v, problem, with_lse=True)
        launch.backward(torch.randn_like(q), q, k, v, out, lse, problem)
        for name, kernel, *_ in _RecordingLauncher.launches:
            annotations = kernel._pyfunc.__annotations__
            parameters = kernel._pyfunc.__code__.co_varnames[: kernel._pyfunc.__code__.co_argcount]
            arrays = [parameter for parameter in ("Q", "Out", "dOut", "Lse", "LseBase2") if parameter in parameters]
            assert arrays and all((annotations.get(a) == ct.IndexedWithInt64) is wide for a in arrays), name
            assert annotations["block_m"] == ct.Constant[int], name
        assert problem.shape_key("sm_90").endswith("|int64-index") is wide
    _RecordingLauncher.launches = []
    d_out = torch.empty_strided(q.shape, (2**31, 40 * 64, 64, 1), dtype=q.dtype, device="meta")
    launch.backward(d_out, q, k, v, out, lse, narrow)
    assert all(kernel._pyfunc.__qualname__.endswith("_int64_index") for _, kernel, *_ in _RecordingLauncher.launches)


# ---- fused backward ---------------------------------------------------------------------------


def _recorded_backward(
    monkeypatch, seqlen=40, head_dim=64, q_heads=4, batch=3, causal=True, mods=score_mods.PLAIN, value_dim=None
):
    monkeypatch.setattr(launch, "_Launcher", _RecordingLauncher)
    _RecordingLauncher.launches = []
    q, k, _ = _cpu_inputs(q_shape=(batch, q_heads, seqlen, head_dim), kv_shape=(batch, 2, seqlen, head_dim))
    v = torch.randn(batch, 2, seqlen, value_dim or head_dim, dtype=q.dtype)
    problem = problem_mod.AttentionProblem(
        batch, q_heads, 2, seqlen, seqlen, head_dim, torch.bfloat16, 0.125, causal, mods=mods, head_dim_v=value_dim
    )
    out, lse = (
        torch.randn(batch, q_heads, seqlen, value_dim or head_dim, dtype=q.dtype),
        torch.randn(batch, q_heads, seqlen),
    )
    grads = launch.backward(torch.randn_like(out), q, k, v, out, lse, problem)
    return [name for name, *_ in _RecordingLauncher.launches], _RecordingLauncher.launches, grads


@pytest.mark.parametrize("q_heads", [2, 4], ids=["mha", "gqa"])
def test_op_fused_backward_arguments(monkeypatch, q_heads):
    """Fused: preprocess then the dK/dV kernel with sum_dq on and an fp32 DQSum of whole tiles;
    grouped (causal, query groups: sum_dkdv) a program per query head, adding into fp32 dK/dV sums."""
    import inspect

    monkeypatch.setenv("TILEGYM_BACKWARD", "fused")
    names, launches, gradients = _recorded_backward(monkeypatch, q_heads=q_heads)  # causal
    dq, dk, dv = gradients.dq, gradients.dk, gradients.dv
    grouped = q_heads > 2
    name = configs.BACKWARD_FUSED_GROUPED if grouped else configs.BACKWARD_FUSED
    assert names == [configs.BACKWARD_PREPROCESS, name]
    _, kernel, grid, args, config = launches[1]
    values = dict(zip(inspect.signature(kernel._pyfunc).parameters, args, strict=True))
    fused = configs.candidates(name, "sm_90", 64, 2)
    assert values["sum_dq"] is True and values["DQSum"].dtype == torch.float32
    padded_m, padded_n = (max(getattr(c, block) for c in fused) for block in ("block_m", "block_n"))
    assert values["DQSum"].shape == (3, q_heads, padded_m, 64)
    assert values["sum_dkdv"] is grouped
    for gradient_name in ("dK", "dV"):
        target = values[gradient_name]
        if grouped:
            assert target.dtype == torch.float32 and target.shape == (3, 2, padded_n, 64)
        else:
            assert target.dtype == torch.bfloat16 and target.shape == (3, 2, 40, 64)
    # The recorder runs no kernel: each gradient that went through a sum is the zeroed sum.
    for gradient in (dq, dk, dv) if grouped else (dq,):
        assert torch.equal(gradient, torch.zeros_like(gradient))
    assert grid == (1, q_heads if grouped else 2, 3)


MIN_FUSED = dispatch.FUSED_BACKWARD_MIN_SEQLEN_K


@pytest.mark.parametrize(
    "choice, seqlen, head_dim, q_heads, causal, deterministic, expected",
    [
        ("auto", 40, 64, 2, True, False, None),  # short: two kernels win
        ("auto", MIN_FUSED, 64, 2, True, False, configs.BACKWARD_FUSED),
        ("auto", MIN_FUSED, 128, 2, False, False, configs.BACKWARD_FUSED),
        ("auto", MIN_FUSED, 128, 4, True, False, configs.BACKWARD_FUSED_GROUPED),  # causal query groups
        ("auto", MIN_FUSED, 64, 4, False, False, configs.BACKWARD_FUSED),  # equal programs: not grouped
        ("auto", MIN_FUSED, 256, 2, True, False, None),  # no D=256 table: dV and dK apart
        ("auto", MIN_FUSED, 192, 2, True, False, None),  # D=256's tables; dV and dK apart too
        ("fused", 40, 64, 4, True, True, None),  # deterministic algorithms always get two kernels
        ("two-kernel", MIN_FUSED, 64, 2, True, False, None),
    ],
)
def test_op_backward_design_choice(monkeypatch, choice, seqlen, head_dim, q_heads, causal, deterministic, expected):
    monkeypatch.setenv("TILEGYM_BACKWARD", choice)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic)
    names, _, _ = _recorded_backward(monkeypatch, seqlen, head_dim, q_heads, batch=1, causal=causal)
    # Two kernels: the dQ kernel writes the row statistics the dK/dV kernel reads, so it runs first;
    # wide heads sum dV and dK in launches of their own (dispatch.split_dkdv).
    apart = [configs.BACKWARD_DV, configs.BACKWARD_DK] if head_dim in (192, 256) else [configs.BACKWARD_DKDV]
    two_kernels = [configs.BACKWARD_DQ, *apart]
    assert names == ([configs.BACKWARD_PREPROCESS, expected] if expected else two_kernels)


@pytest.mark.parametrize(
    "head_dim, value_dim, expected",
    [
        (192, 128, [configs.BACKWARD_DQ, configs.BACKWARD_DKDV]),  # one dK/dV program at 128 keys
        (256, 128, [configs.BACKWARD_DQ, configs.BACKWARD_DV, configs.BACKWARD_DK]),
        (256, 256, [configs.BACKWARD_DQ, configs.BACKWARD_DV, configs.BACKWARD_DK]),
        (192, 192, [configs.BACKWARD_DQ, configs.BACKWARD_DV, configs.BACKWARD_DK]),  # dQ: D=256's table
    ],
)
def test_op_wide_pairs_backward(monkeypatch, head_dim, value_dim, expected):
    """Wide (head dim, V head dim) pairs run the launches and first configs of their own tables
    (configs.PAIR_TABLES), else those of the wider head dim's tile."""
    names, launches, _ = _recorded_backward(monkeypatch, MIN_FUSED, head_dim, 2, batch=1, value_dim=value_dim)
    assert names == expected
    pair = configs.PAIR_TABLES["sm_90"].get((head_dim, value_dim), {})
    for name, *_, config in launches:
        wanted = pair[name][0] if name in pair else configs.candidates(name, "sm_90", 256, 2)[0]
        assert config == wanted, name


_DOCUMENTS = score_functions.document_mask(torch.zeros(1, 8, dtype=torch.int32))
_MASK_ALONE = ScoreMods(user=programmable.user_functions(mask_mod=_DOCUMENTS["mask_mod"]))
_SCORE_AND_MASK = ScoreMods(
    user=programmable.user_functions(**score_functions.softcap(30.0), mask_mod=_DOCUMENTS["mask_mod"])
)
_SOFTCAP_FUNCTION = ScoreMods(user=programmable.user_functions(**score_functions.softcap(30.0)))
_ALIBI_SCORE = score_functions.alibi(torch.zeros(2), 8, 8)["score_mod"]
_ALIBI_FUNCTION = ScoreMods(user=programmable.user_functions(_ALIBI_SCORE, score_functions.additive_grad))


def _undeclared_alibi(score, b, h, q_idx, kv_idx, aux):
    return score - ct.gather(aux[0], h) * ct.abs(ct.astype(q_idx - kv_idx, score.dtype))


# A window that lets a query see MIN_FUSED keys, as many as "auto" asks of the fused backward.
_WIDE_WINDOW = (MIN_FUSED // 2, MIN_FUSED // 2)
_UNDECLARED = ScoreMods(user=programmable.user_functions(_undeclared_alibi, score_functions.additive_grad))
_TABLE = score_functions.relative_position_bias(torch.zeros(2, 9), 4)
_FROZEN_TABLE = ScoreMods(user=programmable.user_functions(_TABLE["score_mod"], _TABLE["score_mod_grad"]))
_LEARNED_TABLE = ScoreMods(user=programmable.user_functions(_TABLE["score_mod"], _TABLE["score_mod_grad"],
                                                            _TABLE["aux_grad"]))  # fmt: skip


@pytest.mark.parametrize(
    "mods, head_dim, fused",
    [
        (ScoreMods(window=_WIDE_WINDOW), 128, True),  # a window only hides scores: the fused tables compile clean
        (ScoreMods(window=_WIDE_WINDOW, sinks=True), 96, True),
        (ScoreMods(window=_WIDE_WINDOW), 64, False),  # lost at D=64 (FUSED_SHORT_LOOPS_HEAD_DIM_TILES)
        (ScoreMods(window=(64, 0)), 128, False),  # two kernels win below MIN_FUSED keys (dispatch.keys_per_query)
        (ScoreMods(softcap=2.0), 128, True),  # spills inside its loops, measured faster all the same
        (ScoreMods(softcap=2.0), 64, True),  # FUSED_SCORES_HEAD_DIM_TILES, on 64x128 tiles
        (ScoreMods(window=(64, 0), softcap=2.0), 128, False),
        (ScoreMods(alibi=True), 64, True),  # on tables of its own (configs.ALIBI_TABLES)
        (ScoreMods(alibi=True), 128, True),
        (ScoreMods(alibi=True, window=(64, 0)), 128, False),  # spilled (variants.WINDOW_OR_ALIBI)
        (_MASK_ALONE, 128, True),  # a mask function hides scores as a window does
        (_MASK_ALONE, 64, False),  # FUSED_SHORT_LOOPS_HEAD_DIM_TILES
        (_SCORE_AND_MASK, 128, False),  # a score function with a mask is not in Variant.modifiers
        (_SOFTCAP_FUNCTION, 128, True),  # declared elementwise (score_functions.elementwise)
        (_ALIBI_FUNCTION, 96, True),
        (_ALIBI_FUNCTION, 64, True),  # FUSED_SCORES_HEAD_DIM_TILES, on 64x128 tiles
        (_UNDECLARED, 128, False),  # compile time and speed unknown: two kernels
        (_FROZEN_TABLE, 128, False),  # a table read per score: slower fused, so not declared
        (_LEARNED_TABLE, 128, False),
    ],
    ids=[
        "window",
        "window-sinks-d96",
        "window-d64",
        "short-window",
        "softcap",
        "softcap-d64",
        "window-softcap",
        "alibi",
        "alibi-d128",
        "alibi-window",
        "mask",
        "mask-d64",
        "score-and-mask",
        "softcap-function",
        "alibi-function-d96",
        "alibi-function-d64",
        "undeclared-function",
        "frozen-table",
        "learned-table",
    ],
)
def test_op_fused_backward_takes_only_the_switches_it_compiles_with(monkeypatch, mods, head_dim, fused):
    monkeypatch.setenv("TILEGYM_BACKWARD", "auto")
    names, launches, _ = _recorded_backward(
        monkeypatch, MIN_FUSED, head_dim, q_heads=2, batch=1, causal=False, mods=mods
    )
    if not fused:
        assert configs.BACKWARD_FUSED not in names
        return
    assert names == [configs.BACKWARD_PREPROCESS, configs.BACKWARD_FUSED]
    import inspect

    _, kernel, _, args, _ = launches[1]
    values = dict(zip(inspect.signature(kernel._pyfunc).parameters, args, strict=True))
    assert values["alibi"] is mods.alibi
    assert values["capped"] is bool(mods.softcap)
    if mods.window is not None:
        assert values["windowed"] is True and (values["window_left"], values["window_right"]) == mods.window


@pytest.mark.parametrize(
    "mods, fused",
    [(ScoreMods(alibi=True), True), (ScoreMods(window=(64, 0)), True), (ScoreMods(window=(64, 0), alibi=True), False)],
    ids=["alibi", "window", "window-alibi"],
)
def test_op_forced_fused_backward_takes_a_window_or_alibi_not_both(monkeypatch, mods, fused):
    """variants.WINDOW_OR_ALIBI: together they spilled on the fused tables."""
    monkeypatch.setenv("TILEGYM_BACKWARD", "fused")
    names, _, _ = _recorded_backward(monkeypatch, MIN_FUSED, 128, q_heads=2, batch=1, causal=False, mods=mods)
    assert (configs.BACKWARD_FUSED in names) == fused


@pytest.mark.parametrize("choice", ["auto", "fused"])
def test_op_fused_backward_takes_softcap_only_dense_ungrouped_at_d128(monkeypatch, choice):
    """Softcap's fused backward was measured dense and ungrouped at D=128 (perf-notes#fused-backward-softcap):
    forced or not, causal query groups keep two kernels with it."""
    monkeypatch.setenv("TILEGYM_BACKWARD", choice)
    capped = ScoreMods(softcap=2.0)
    names, _, _ = _recorded_backward(monkeypatch, MIN_FUSED, 128, q_heads=4, batch=1, causal=True, mods=capped)
    assert configs.BACKWARD_FUSED_GROUPED not in names and configs.BACKWARD_FUSED not in names
    names, _, _ = _recorded_backward(monkeypatch, MIN_FUSED, 128, q_heads=2, batch=1, causal=True, mods=capped)
    assert names == [configs.BACKWARD_PREPROCESS, configs.BACKWARD_FUSED]


@pytest.mark.parametrize("choice", ["auto", "fused"])
def test_op_fused_backward_takes_only_declared_score_functions(monkeypatch, choice):
    """Forced or not, only a score function declared elementwise takes the fused backward, dense
    and ungrouped (perf-notes#elementwise-functions-fused)."""
    monkeypatch.setenv("TILEGYM_BACKWARD", choice)
    for mods, fused in ((_ALIBI_FUNCTION, True), (_UNDECLARED, False), (_LEARNED_TABLE, False)):
        names, _, _ = _recorded_backward(monkeypatch, MIN_FUSED, 128, q_heads=2, batch=1, causal=True, mods=mods)
        assert (configs.BACKWARD_FUSED in names) == fused
    names, _, _ = _recorded_backward(
        monkeypatch, MIN_FUSED, 128, q_heads=4, batch=1, causal=True, mods=_ALIBI_FUNCTION
    )  # fmt: skip
    assert configs.BACKWARD_FUSED_GROUPED not in names and configs.BACKWARD_FUSED not in names


def test_op_fused_backward_grouped_takes_a_mask_function(monkeypatch):
    """Causal query groups with a mask function alone take the fused backward's grouped form from
    FUSED_BACKWARD_MIN_SEQLEN_K keys at D=128 (perf-notes#grouped-fused-masks)."""
    monkeypatch.setenv("TILEGYM_BACKWARD", "auto")
    names, _, _ = _recorded_backward(monkeypatch, MIN_FUSED, 128, q_heads=4, batch=1, causal=True, mods=_MASK_ALONE)
    assert names == [configs.BACKWARD_PREPROCESS, configs.BACKWARD_FUSED_GROUPED]


def test_op_backward_choice_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv("TILEGYM_BACKWARD", "fast")
    with pytest.raises(ValueError, match="TILEGYM_BACKWARD"):
        dispatch.backward_choice()


def _layout(value):
    """What a launch is compiled for, of one argument: an array's dtype, shape and strides."""
    if isinstance(value, torch.Tensor):
        return value.dtype, tuple(value.shape), value.stride()
    return value


@pytest.mark.parametrize(
    "choice, q_heads, bias_grad, sinks_grad",
    [
        ("two-kernel", 4, False, False),
        ("fused", 2, False, False),
        ("fused", 4, False, False),
        ("two-kernel", 4, True, False),
        ("two-kernel", 4, False, True),
        ("fused", 2, False, True),
    ],
    ids=["two-kernel", "fused", "fused-grouped", "bias-grad", "sinks-grad", "fused-sinks-grad"],
)
def test_op_backward_compiled_ahead_as_launched(monkeypatch, choice, q_heads, bias_grad, sinks_grad):
    """compile_backward_ahead starts the launches backward() makes, once per problem: the same
    kernels and grids, arguments of the same dtypes, shapes, strides and constants."""
    monkeypatch.setenv("TILEGYM_BACKWARD", choice)
    monkeypatch.setattr(launch, "_Launcher", _RecordingLauncher)
    monkeypatch.setattr(launch, "_compiled_ahead", collections.OrderedDict())
    _RecordingLauncher.launches, _RecordingLauncher.compiled_ahead = [], []
    batch, seqlen_q, seqlen_k = 3, 40, 24
    # [B, S, H, D] views, as a model hands them over.
    q = torch.randn(batch, seqlen_q, q_heads, 64, dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(batch, seqlen_k, 2, 64, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    mods, tensors = score_mods.PLAIN, score_mods.NO_TENSORS
    if bias_grad:
        bias = torch.randn(q_heads, seqlen_q, seqlen_k, dtype=torch.bfloat16)
        mode, kernel_bias = score_mods.check_bias(bias, q, seqlen_k, q_heads)
        mods, tensors = ScoreMods(bias_mode=mode, bias_shape=tuple(bias.shape)), score_mods.ModTensors(kernel_bias)
    if sinks_grad:
        mods, tensors = (
            ScoreMods(sinks=True),
            score_mods.ModTensors(sinks=score_mods.check_sinks(torch.randn(q_heads), q, q_heads)),
        )
    problem = problem_mod.AttentionProblem(batch, q_heads, 2, seqlen_q, seqlen_k, 64, torch.bfloat16, 0.125, True, mods)
    for _ in range(2):
        launch.compile_backward_ahead(q, k, v, problem, tensors, bias_grad, sinks_grad)
    out, lse = torch.randn(batch, q_heads, seqlen_q, 64, dtype=torch.bfloat16), torch.randn(batch, q_heads, seqlen_q)
    launch.backward(
        torch.randn_like(out), q, k, v, out, lse, problem, mod_tensors=tensors, bias_grad=bias_grad,
        sinks_grad=sinks_grad,
    )  # fmt: skip

    ahead, launched = _RecordingLauncher.compiled_ahead, _RecordingLauncher.launches
    assert len(launched) == 2  # preprocess and fused kernel, or dQ then dK/dV
    for started, made in zip(ahead, launched, strict=True):
        (name, kernel, grid, args, _), (made_name, made_kernel, made_grid, made_args, _) = started, made
        assert (name, kernel, grid) == (made_name, made_kernel, made_grid)
        assert [_layout(a) for a in args] == [_layout(a) for a in made_args], name


@pytest.mark.parametrize("choice", ["two-kernel", "fused"])
def test_op_packed_backward_compiled_ahead_as_launched(monkeypatch, choice):
    """Packed, compile_backward_ahead takes the caller's [total, H, D] tensors and starts the
    launches backward_packed makes, once per problem; a known problem makes no views."""
    monkeypatch.setenv("TILEGYM_BACKWARD", choice)
    monkeypatch.setattr(launch, "_Launcher", _RecordingLauncher)
    monkeypatch.setattr(launch, "_compiled_ahead", collections.OrderedDict())
    _RecordingLauncher.launches, _RecordingLauncher.compiled_ahead = [], []
    q, k, v = (torch.randn(21, heads, 64, dtype=torch.bfloat16) for heads in (4, 2, 2))
    cu = torch.tensor([0, 5, 21], dtype=torch.int32)
    problem, tensors, lengths = _checked_on_the_cpu(q, k, v, cu, cu, 16, 16, None, True)
    launch.compile_backward_ahead(q, k, v, problem, tensors, False, False, lengths)
    heads_major = launch.packing.heads_major
    monkeypatch.setattr(launch.packing, "heads_major", None)  # a known problem makes no views
    launch.compile_backward_ahead(q, k, v, problem, tensors, False, False, lengths)
    monkeypatch.setattr(launch.packing, "heads_major", heads_major)
    out, lse = torch.randn_like(q), torch.randn(4, 21)
    launch.backward_packed(torch.randn_like(out), q, k, v, out, lse, problem, tensors, lengths, None, False)

    ahead, launched = _RecordingLauncher.compiled_ahead, _RecordingLauncher.launches
    assert len(launched) == 2 and len(ahead) == 2
    for started, made in zip(ahead, launched, strict=True):
        (name, kernel, grid, args, _), (made_name, made_kernel, made_grid, made_args, _) = started, made
        assert (name, kernel, grid) == (made_name, made_kernel, made_grid)
        assert [_layout(a) for a in args] == [_layout(a) for a in made_args], name


def test_op_backward_not_compiled_ahead_without_memory_for_stand_ins(monkeypatch):
    """Compiling ahead is only a head start: when its stand-in tensors do not fit, the forward goes on."""

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("no memory for stand-ins")

    monkeypatch.setattr(launch, "_Launcher", _RecordingLauncher)
    monkeypatch.setattr(launch, "_compiled_ahead", collections.OrderedDict())
    monkeypatch.setattr(launch, "_gradients", out_of_memory)
    _RecordingLauncher.compiled_ahead = []
    q, k, v = _cpu_inputs()
    problem = problem_mod.AttentionProblem(1, 4, 2, 16, 16, 64, torch.bfloat16, 0.125, True)
    launch.compile_backward_ahead(q, k, v, problem)
    assert _RecordingLauncher.compiled_ahead == []


# ---- forward with a fixed row max -------------------------------------------------------------

MIN_FIXED_MAX = dispatch.FIXED_MAX_FORWARD_MIN_MEAN_KEYS
BOUNDED_CAP = dispatch.BOUNDED_SOFTCAP_MAX


@pytest.mark.parametrize(
    "head_dim, seqlen_q, seqlen_k, causal, dtype, mods, expected",
    [
        (128, 8, MIN_FIXED_MAX[128], False, torch.bfloat16, None, True),
        (128, 8, MIN_FIXED_MAX[128] - 1, False, torch.bfloat16, None, False),  # too few keys
        (96, 8, MIN_FIXED_MAX[128], False, torch.float16, None, True),  # on 128-wide tiles
        (64, 8, MIN_FIXED_MAX[64], False, torch.bfloat16, None, True),
        (64, 8, MIN_FIXED_MAX[128], False, torch.bfloat16, None, False),  # D=64 needs more keys
        # Causal rows see (seqlen_k - 7 ... seqlen_k) keys, seqlen_k - 3.5 on average.
        (128, 8, MIN_FIXED_MAX[128] + 3, True, torch.bfloat16, None, False),
        (128, 8, MIN_FIXED_MAX[128] + 4, True, torch.bfloat16, None, True),
        # Square causal: (seqlen + 1) / 2 keys on average.
        (64, 2 * MIN_FIXED_MAX[64] - 2, 2 * MIN_FIXED_MAX[64] - 2, True, torch.bfloat16, None, False),
        (64, 2 * MIN_FIXED_MAX[64] - 1, 2 * MIN_FIXED_MAX[64] - 1, True, torch.bfloat16, None, True),
        (128, 8, MIN_FIXED_MAX[128], False, torch.float32, None, False),  # fp32 keeps the running max
        # Softcap alone in bf16: its cap is the fixed max at any length, causal or not, up to
        # dispatch.BOUNDED_SOFTCAP_MAX; fp16 P would underflow, a larger cap (Gemma 2's 50) might.
        (128, 8, 8, False, torch.bfloat16, ScoreMods(softcap=30.0), True),
        (64, 300, 170, True, torch.bfloat16, ScoreMods(softcap=BOUNDED_CAP), True),
        (128, 8, 8, False, torch.bfloat16, ScoreMods(softcap=math.nextafter(BOUNDED_CAP, math.inf)), False),
        (128, 8, 8, False, torch.bfloat16, ScoreMods(softcap=50.0), False),
        (128, 8, MIN_FIXED_MAX[128], False, torch.float16, ScoreMods(softcap=30.0), False),
        (128, 8, MIN_FIXED_MAX[128], False, torch.float32, ScoreMods(softcap=30.0), False),
        (128, 8, MIN_FIXED_MAX[128] + 4, True, torch.bfloat16, ScoreMods(softcap=30.0, window=(64, 0)), False),
        (256, 8, 8, False, torch.bfloat16, ScoreMods(softcap=30.0), False),  # no table
        # ALiBi alone: its fixed max comes from the diagonal's key tiles, causal or not; not with
        # a window, nor with too few keys.
        (128, 8, MIN_FIXED_MAX[128] + 4, True, torch.bfloat16, ScoreMods(alibi=True), True),
        (64, 8, MIN_FIXED_MAX[64] + 4, True, torch.float16, ScoreMods(alibi=True), True),
        (128, 8, MIN_FIXED_MAX[128], False, torch.bfloat16, ScoreMods(alibi=True), True),
        (128, 8, MIN_FIXED_MAX[128] - 1, False, torch.bfloat16, ScoreMods(alibi=True), False),
        (128, 8, MIN_FIXED_MAX[128], False, torch.bfloat16, ScoreMods(alibi=True, window=(64, 64)), False),
        (128, 8, MIN_FIXED_MAX[128] + 4, True, torch.bfloat16, ScoreMods(alibi=True, softcap=30.0), False),
        # A score function alone starts from the diagonal (causal: its masked tiles, as ALiBi;
        # without a mask: the key tile on it); not with a mask, nor with too few keys.
        (128, 8, MIN_FIXED_MAX[128] + 4, True, torch.bfloat16, _UNDECLARED, True),
        (128, 8, MIN_FIXED_MAX[128], False, torch.bfloat16, _UNDECLARED, True),
        (128, 8, MIN_FIXED_MAX[128] - 1, False, torch.bfloat16, _UNDECLARED, False),
        (64, 8, MIN_FIXED_MAX[64], False, torch.bfloat16, _UNDECLARED, True),
        (128, 8, MIN_FIXED_MAX[128] + 4, True, torch.bfloat16, _SCORE_AND_MASK, False),
        (256, 8, 1 << 16, False, torch.bfloat16, None, False),  # no table
        (128, 8, MIN_FIXED_MAX[128], False, torch.bfloat16, "wide", False),  # int64 indexing
    ],
)
def test_op_forward_fixed_max_choice(monkeypatch, head_dim, seqlen_q, seqlen_k, causal, dtype, mods, expected):
    """Both forwards switch to the fixed-max kernels together, with fixed_max on in their arguments."""
    import inspect

    monkeypatch.setattr(launch, "_Launcher", _RecordingLauncher)
    _RecordingLauncher.launches = []
    q, k, v = _cpu_inputs(q_shape=(1, 2, seqlen_q, head_dim), kv_shape=(1, 2, seqlen_k, head_dim), dtype=dtype)
    wide = mods == "wide"
    mods = score_mods.PLAIN if wide or mods is None else mods
    problem = problem_mod.AttentionProblem(1, 2, 2, seqlen_q, seqlen_k, head_dim, dtype, 0.1, causal, mods, wide)
    launch.forward(q, k, v, problem, with_lse=True)
    launch.forward(q, k, v, problem, with_lse=False)
    names = [name for name, *_ in _RecordingLauncher.launches]
    if expected:
        assert names == [configs.FORWARD_LSE_FIXED_MAX, configs.FORWARD_FIXED_MAX]
    else:
        assert names == [configs.FORWARD_LSE, configs.FORWARD]
    for _, kernel, _, args, _ in _RecordingLauncher.launches:
        values = dict(zip(inspect.signature(kernel._pyfunc).parameters, args, strict=True))
        assert values["fixed_max"] is expected


def test_op_fixed_max_thresholds_cover_their_tables():
    """Every head-dim tile with a fixed-max forward table has a key length to start from."""
    for arch in configs.ARCHS:
        for kernel in (configs.FORWARD_FIXED_MAX, configs.FORWARD_LSE_FIXED_MAX):
            assert set(configs.TABLES[arch][kernel]) <= set(dispatch.FIXED_MAX_FORWARD_MIN_MEAN_KEYS), (arch, kernel)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (1, 9), (7, 7), (5, 12), (12, 5), (300, 4099), (4099, 4099)])
def test_op_mean_keys_per_query_counts_the_causal_mask(seqlen_q, seqlen_k):
    """The mean of each row's visible keys under the reference's causal mask."""
    problem = problem_mod.AttentionProblem(1, 1, 1, seqlen_q, seqlen_k, 64, torch.bfloat16, 0.1, True)
    visible = causal_mask(seqlen_q, seqlen_k).sum().item()
    assert dispatch.mean_keys_per_query(problem) == pytest.approx(visible / seqlen_q, rel=1e-12)
    full = problem_mod.AttentionProblem(1, 1, 1, seqlen_q, seqlen_k, 64, torch.bfloat16, 0.1, False)
    assert dispatch.mean_keys_per_query(full) == seqlen_k


@pytest.mark.parametrize("choice", ["two-kernel", "fused"])
def test_op_sinks_shares_are_zeroed_before_the_launch_that_counts(monkeypatch, choice):
    """The kernel that writes the sinks' gradient shares (dQ, or the fused backward's preprocess)
    gets a reset that zeroes them: tuning runs of configs with smaller query tiles write shares
    the chosen config leaves alone."""
    monkeypatch.setenv("TILEGYM_BACKWARD", choice)
    monkeypatch.setattr(launch, "_Launcher", _RecordingLauncher)
    _RecordingLauncher.launches = []
    q, k, v = _cpu_inputs(q_shape=(1, 4, 40, 64), kv_shape=(1, 2, 2100, 64))
    sinks = score_mods.check_sinks(torch.randn(4), q, 4)
    problem = problem_mod.AttentionProblem(
        1, 4, 2, 40, 2100, 64, torch.bfloat16, 0.125, False, ScoreMods(sinks=True)
    )  # fmt: skip
    out, lse = torch.randn_like(q), torch.randn(1, 4, 40)
    seen = []
    reset_of = {}

    class Spy(_RecordingLauncher):
        def launch(self, step):
            config = self.candidates(step.name)[0]
            values = dict(zip(launching.parameter_names(step.kernel), step.args(config), strict=True))
            if values.get("sinks_grad"):
                values["DSinks"].fill_(7.0)  # what a tuning run of another config leaves
                reset_of[step.name] = step.reset
            super().launch(step)
            if values.get("sinks_grad"):
                seen.append(values["DSinks"].abs().max().item())

    monkeypatch.setattr(launch, "_Launcher", Spy)
    gradients = launch.backward(
        torch.randn_like(q), q, k, v, out, lse, problem, mod_tensors=score_mods.ModTensors(sinks=sinks), sinks_grad=True
    )  # fmt: skip
    writer = configs.BACKWARD_PREPROCESS if choice == "fused" else configs.BACKWARD_DQ
    assert list(reset_of) == [writer] and reset_of[writer] is not None
    assert seen == [0.0] and torch.equal(gradients.d_sinks, torch.zeros(4))


def test_op_sinks_without_keys():
    """Sk = 0 with sinks: every row's mass is its sink's, so the output is 0, the LSE the sink
    (-inf for a -inf sink), and dSink_h the sum of dLSE over the head's rows."""
    q = torch.randn(2, 3, 5, 64, dtype=torch.float64)
    k = v = torch.randn(2, 3, 0, 64, dtype=torch.float64)
    sinks = torch.tensor([0.5, -1.0, -math.inf], dtype=torch.float64)
    problem = problem_mod.AttentionProblem(2, 3, 3, 5, 0, 64, torch.float64, 0.125, False, ScoreMods(sinks=True))
    tensors = score_mods.ModTensors(sinks=sinks)
    out, lse = launch.forward(q, k, v, problem, with_lse=True, mod_tensors=tensors)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, sinks.reshape(1, 3, 1).expand(2, 3, 5))
    d_lse = torch.randn(2, 3, 5, dtype=torch.float64)
    grads = launch.backward(torch.randn_like(out), q, k, v, out, lse, problem, mod_tensors=tensors, d_lse=d_lse,
                            sinks_grad=True)  # fmt: skip
    expected = d_lse.sum(dim=(0, 2))
    expected[2] = 0.0
    assert torch.equal(grads.d_sinks, expected) and torch.equal(grads.dq, torch.zeros_like(q))
    # The reference agrees: autograd of a softmax over the sink alone.
    q_ref = q.clone().requires_grad_()
    sink_ref = sinks[:2].clone().requires_grad_()
    _, ref_lse = attention_reference(q_ref[:, :2], k[:, :2], v[:, :2], is_causal=False, sinks=sink_ref)
    assert torch.equal(ref_lse, lse[:, :2])
    (ref_lse * d_lse[:, :2]).sum().backward()
    torch.testing.assert_close(sink_ref.grad, expected[:2])


# ---- packed batches ------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["auto", "fused"])
def test_op_packed_launch_arguments(monkeypatch, choice):
    """A packed batch launches the forward and the backward (two kernels below 2048 keys; forced
    fused, causal GQA: the preprocess and the grouped form) with varlen on, its cumulative lengths
    and longest lengths, the [1, H, total, D] views of its own tensors (fp32 sums of every
    sequence's rows for what the fused backward sums), and a grid of the longest sequence's tiles
    x heads x sequences; outputs and gradients come back in the packed layout. The preprocess,
    whose rows do not depend on their sequence, runs dense over all rows: varlen off, a grid of
    every row's tiles x heads x 1."""
    import inspect

    from tilegym.ops.attention.packing import CuSeqlens
    from tilegym.ops.attention.problem import Packing
    from tilegym.ops.attention.score_mods import NO_TENSORS

    monkeypatch.setenv("TILEGYM_BACKWARD", choice)
    monkeypatch.setattr(launch, "_Launcher", _RecordingLauncher)
    _RecordingLauncher.launches = []
    total_q, total_k, q_heads, kv_heads, head_dim = 50, 60, 4, 2, 64
    q = torch.randn(total_q, q_heads, head_dim, dtype=torch.bfloat16)
    k, v = (torch.randn(total_k, kv_heads, head_dim, dtype=torch.bfloat16) for _ in range(2))
    cu_seqlens = CuSeqlens(torch.tensor([0, 20, 50], dtype=torch.int32), torch.tensor([0, 35, 60], dtype=torch.int32))
    problem = problem_mod.AttentionProblem(
        2, q_heads, kv_heads, 30, 35, head_dim, torch.bfloat16, 0.125, True, packing=Packing(total_q, total_k)
    )
    out, lse = launch.forward_packed(q, k, v, problem, True, NO_TENSORS, cu_seqlens)
    d_out = torch.randn_like(out)
    grads = launch.backward_packed(d_out, q, k, v, out, lse, problem, NO_TENSORS, cu_seqlens, None, False)

    assert out.shape == (total_q, q_heads, head_dim) and out.is_contiguous() and lse.shape == (q_heads, total_q)
    assert [tuple(g.shape) for g in (grads.dq, grads.dk, grads.dv)] == [tuple(t.shape) for t in (q, k, v)]
    launched = [name for name, *_ in _RecordingLauncher.launches]
    fused = choice == "fused"
    backward = [configs.BACKWARD_PREPROCESS, configs.BACKWARD_FUSED_GROUPED]
    assert launched == [configs.FORWARD_LSE, *(backward if fused else [configs.BACKWARD_DQ, configs.BACKWARD_DKDV])]
    packed = {"Q": q, "K": k, "V": v, "Out": out, "dOut": d_out}
    if not fused:
        packed |= {"dQ": grads.dq, "dK": grads.dk, "dV": grads.dv}
    for name, kernel, grid, args, config in _RecordingLauncher.launches:
        values = dict(zip(inspect.signature(kernel._pyfunc).parameters, args, strict=True))
        as_one = name == configs.BACKWARD_PREPROCESS
        assert values["varlen"] is not as_one, name
        # Run as one, the preprocess places each row's statistics by its sequence.
        assert values["CuSeqlensQ"] is cu_seqlens.q, name
        if as_one:
            assert values["stats_by_sequence"] is True and values["search_steps"] == 2, name
        else:
            assert values["max_seqlen_q"] == 30 and values["max_seqlen_k"] == 35, name
            assert values["CuSeqlensK"] is cu_seqlens.k, name
        for stat in ("Delta", "LseBase2"):  # the backward's layout: 50 rows, 2 x 127 to align, whole tiles
            if stat in values:
                assert values[stat].shape == (1, q_heads, 384) and values[stat].dtype == torch.float32, name
        for parameter, tensor in packed.items():
            if parameter in values:
                view = values[parameter]
                assert view.data_ptr() == tensor.data_ptr(), f"{name}: {parameter}"
                assert view.shape == (1, tensor.shape[1], tensor.shape[0], tensor.shape[2]), f"{name}: {parameter}"
        if "Lse" in values:
            assert values["Lse"].data_ptr() == lse.data_ptr() and values["Lse"].shape == (1, q_heads, total_q), name
        if name == configs.BACKWARD_FUSED_GROUPED:
            for parameter, heads, total in (
                ("DQSum", q_heads, total_q),
                ("dK", kv_heads, total_k),
                ("dV", kv_heads, total_k),
            ):
                target = values[parameter]
                assert target.dtype == torch.float32 and target.shape[:2] == (1, heads), parameter
                assert total <= target.shape[2] < total + configs.MAX_BLOCK, parameter
        keys = VARIANTS[name].tiles == "key"
        block = config.block_n if keys else config.block_m
        heads = q_heads if VARIANTS[name].heads == "query" else kv_heads
        if as_one:
            assert grid == (math.ceil(total_q / block), heads, 1), name
        else:
            assert grid == (math.ceil((35 if keys else 30) / block), heads, 2), name


@pytest.mark.parametrize(
    "lengths", [[5, 0, 7, 1, 1, 13], [0, 0, 0], [4, 4, 4, 4], [1] * 40, [3000, *([17] * 20)]], ids=str
)
def test_op_packed_backward_stat_rows_fit(lengths):
    """The packed backward's row statistics (packing.backward_row_stats): each sequence's rows
    start at a multiple of STAT_ALIGN no earlier than its start plus (STAT_ALIGN - 1) per sequence
    before it (kernels/packed.py, stat_rows, restated here), so that whole tiles of its rows, which
    the dK/dV loop reads, never reach the next sequence's and all fit in stat_rows_total rows."""
    from itertools import accumulate

    align = packing.STAT_ALIGN
    starts = [0, *accumulate(lengths)]
    total = packing.stat_rows_total(starts[-1], len(lengths))
    assert total % align == 0 and total >= starts[-1]
    end = 0
    for seq, (start, length) in enumerate(zip(starts, lengths, strict=False)):
        first = (start + (align - 1) * (seq + 1)) // align * align
        assert first % align == 0 and first >= end
        end = first + math.ceil(length / align) * align
        assert end <= total
    assert 2 ** packing.search_steps(len(lengths)) >= len(lengths)  # halvings of [0, N) to one


def test_op_packed_backward_stats_are_zeroed_disjoint_aligned_halves():
    """Delta and the base-2 LSE of a packed backward (packing.backward_row_stats): zeroed, each
    [1, Hq, stat_rows_total], disjoint halves of one allocation, the second 16-byte aligned."""
    from tilegym.ops.attention.problem import Packing

    problem = problem_mod.AttentionProblem(
        3, 5, 5, 70, 70, 64, torch.bfloat16, 0.125, True, score_mods.PLAIN, packing=Packing(131, 131)
    )
    delta, lse_base2 = packing.backward_row_stats(problem, "cpu")
    rows = packing.stat_rows_total(131, 3)
    for stat in (delta, lse_base2):
        assert stat.shape == (1, 5, rows) and stat.is_contiguous() and not stat.any()
    gap = lse_base2.data_ptr() - delta.data_ptr()
    assert gap == 5 * rows * delta.element_size() and gap % 16 == 0
    lse_base2.fill_(1.0)
    assert not delta.any()


def test_op_packed_stat_align_divides_every_query_tile():
    """The dK/dV kernel reads a packed sequence's statistics from the tile index of its first row
    (kernels/packed.py, stat_first_tile): every query tile of every table must divide STAT_ALIGN."""
    query_tiles = {config.block_m for config in configs._all_configs()}
    assert query_tiles and all(packing.STAT_ALIGN % block_m == 0 for block_m in query_tiles), sorted(query_tiles)


@pytest.mark.parametrize("block_m, packed, refused", [(256, True, True), (64, True, False), (256, False, False)])
def test_op_packed_fused_forced_query_tile_must_divide_stat_align(block_m, packed, refused):
    """A forced config whose query tile does not divide STAT_ALIGN would read a packed sequence's
    statistics at the wrong tile (kernels/packed.py, stat_first_tile): refused for the packed
    fused backward, before any launch, naming force_config; dense calls and dividing tiles pass."""
    from tilegym.ops.attention.problem import Packing

    problem = problem_mod.AttentionProblem(
        2, 2, 2, 64, 64, 64, torch.bfloat16, 0.125, True, score_mods.PLAIN,
        packing=Packing(70, 70) if packed else None,
    )  # fmt: skip
    forced = autotune.TileConfig(block_m=block_m, block_n=128)
    with autotune.force_config(configs.BACKWARD_FUSED, forced):
        launcher = _RecordingLauncher(problem, "cpu")
        if refused:
            with pytest.raises(ValueError, match="force_config.*block_m dividing 128, got 256"):
                launcher.candidates(configs.BACKWARD_FUSED)
        else:
            assert launcher.candidates(configs.BACKWARD_FUSED) == (forced,)
        assert launcher.candidates(configs.BACKWARD_DQ) != (forced,)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "dense"])
@pytest.mark.parametrize("mods", [score_mods.PLAIN, ScoreMods(window=(64, 0))], ids=["plain", "window"])
def test_op_fused_backward_d64_runs_128x128_untuned(packed, mods):
    """The D=64 fused backward runs 128x128 untuned, packed or dense: timed alone, 64x128 came
    close enough that tunings of packed batches picked it, while in the whole backward it ran
    6-14% slower on every shape measured. A mask function alone keeps both tiles for the tuner;
    the forward's tables keep their candidates."""
    from tilegym.ops.attention.problem import Packing

    problem = problem_mod.AttentionProblem(
        2, 32, 32, 2048, 2048, 64, torch.bfloat16, 0.125, False, mods,
        packing=Packing(2048, 2048) if packed else None,
    )  # fmt: skip
    launcher = _RecordingLauncher(problem, "cpu")
    first = autotune.TileConfig(128, 128, num_worker_warps=8)
    assert launcher.candidates(configs.BACKWARD_FUSED) == (first,)
    masked = configs.candidates(configs.BACKWARD_FUSED, "sm_90", 64, 2, configs.ScoreTables.MASKS)
    assert masked == (first, autotune.TileConfig(64, 128, num_worker_warps=8))
    tables = configs.score_tables(mods.switches)
    forward = configs.candidates(configs.FORWARD_LSE, "sm_90", 64, 2, tables)
    assert len(forward) > 1 and launcher.candidates(configs.FORWARD_LSE) == forward


_FUSED, _GROUPED = configs.BACKWARD_FUSED, configs.BACKWARD_FUSED_GROUPED


@pytest.mark.parametrize(
    "head_dim, causal, mods, q_heads, chosen",
    [
        (128, True, score_mods.PLAIN, 2, _FUSED),
        (64, True, score_mods.PLAIN, 2, _FUSED),  # FUSED_PACKED_HEAD_DIM_TILES
        (64, False, score_mods.PLAIN, 2, _FUSED),
        (64, False, ScoreMods(window=(64, 64)), 2, None),
        (128, False, ScoreMods(window=(64, 64)), 2, _FUSED),
        (128, True, score_mods.PLAIN, 4, _GROUPED),
        (64, True, score_mods.PLAIN, 4, None),  # grouped: FUSED_SHORT_LOOPS_HEAD_DIM_TILES
    ],
    ids=["d128-causal", "d64-causal", "d64-full", "d64-window", "d128-window", "d128-causal-gqa", "d64-causal-gqa"],
)
def test_op_packed_backward_design_choice(monkeypatch, head_dim, causal, mods, q_heads, chosen):
    """ "auto" on a packed batch whose longest sequence has FUSED_BACKWARD_MIN_SEQLEN_K keys: the
    fused backward at D=128 (dispatch.FUSED_SHORT_LOOPS_HEAD_DIM_TILES), and without a window or a
    mask function at D=64 too (FUSED_PACKED_HEAD_DIM_TILES), but not in the grouped form of
    causal query groups."""
    from tilegym.ops.attention.problem import Packing

    monkeypatch.setenv("TILEGYM_BACKWARD", "auto")
    seqlen = dispatch.FUSED_BACKWARD_MIN_SEQLEN_K
    problem = problem_mod.AttentionProblem(
        2, q_heads, 2, seqlen, seqlen, head_dim, torch.bfloat16, 0.125, causal, mods,
        packing=Packing(seqlen + 5, seqlen + 5),
    )  # fmt: skip
    assert dispatch.fused_backward(problem, _RecordingLauncher(problem, "cpu").candidates, False) == chosen


@pytest.mark.parametrize(
    "causal, window, fused",
    [(True, (1023, 0), False), (True, (2047, 0), True), (False, (1024, 1024), True), (False, (511, 512), False)],
    ids=["causal-1024", "causal-2048", "full-2049", "full-1024"],
)
def test_op_window_backward_design_choice(monkeypatch, causal, window, fused):
    """ "auto" with a window alone, dense, at D=128 and 16384 keys: two kernels where a query sees
    fewer than FUSED_BACKWARD_MIN_SEQLEN_K keys (dispatch.keys_per_query), the fused backward from
    there on; causal query groups and packed windows (test_op_packed_backward_design_choice) keep
    the fused one."""
    monkeypatch.setenv("TILEGYM_BACKWARD", "auto")
    assert window[0] + window[1] + 1 in (1024, 2048, 2049)
    problem = problem_mod.AttentionProblem(
        1, 2, 2, 16384, 16384, 128, torch.bfloat16, 0.125, causal, ScoreMods(window=window)
    )
    chosen = dispatch.fused_backward(problem, _RecordingLauncher(problem, "cpu").candidates, False)
    assert chosen == (configs.BACKWARD_FUSED if fused else None)
    monkeypatch.setenv("TILEGYM_BACKWARD", "fused")
    assert dispatch.fused_backward(problem, _RecordingLauncher(problem, "cpu").candidates, False) is not None
    if causal:
        monkeypatch.setenv("TILEGYM_BACKWARD", "auto")
        grouped = dataclasses.replace(problem, q_heads=8)  # causal query groups keep their grouped form
        chosen = dispatch.fused_backward(grouped, _RecordingLauncher(grouped, "cpu").candidates, False)
        assert chosen == configs.BACKWARD_FUSED_GROUPED


def test_op_dense_launches_carry_no_packing(monkeypatch):
    """Dense calls pass varlen off and an int32 placeholder for the cumulative lengths."""
    import inspect

    monkeypatch.setattr(launch, "_Launcher", _RecordingLauncher)
    _RecordingLauncher.launches = []
    q, k, v = _cpu_inputs()
    problem = problem_mod.AttentionProblem(1, 4, 2, 16, 16, 64, torch.bfloat16, 0.125, True)
    launch.forward(q, k, v, problem, with_lse=True)
    (name, kernel, _, args, _), *_ = _RecordingLauncher.launches
    values = dict(zip(inspect.signature(kernel._pyfunc).parameters, args, strict=True))
    assert values["varlen"] is False and values["CuSeqlensQ"].dtype == torch.int32


def test_op_packed_calls_are_checked_in_full_once(monkeypatch):
    """As for dense calls: a packed call like one checked before takes its problem (with this
    call's cumulative lengths, sinks and slopes); other lengths, max lengths or modifiers are
    checked in full once; a 0-d tensor max length or TILEGYM_CHECK_VARLEN (which reads the
    lengths' contents) go through every check."""
    from tilegym.ops.attention import packing

    calls = []

    def full_checks(q, k, v, cu_seqlens_q, cu_seqlens_k, *rest):
        calls.append(rest)
        problem = problem_mod.AttentionProblem(2, 4, 2, 8, 8, 64, q.dtype, 0.125, True)
        return problem, score_mods.ModTensors(), packing.CuSeqlens(cu_seqlens_q, cu_seqlens_k)

    monkeypatch.setattr(packing, "_check_in_full", full_checks)
    monkeypatch.setattr(packing, "_checked_calls", problem_mod.CheckedCalls())
    monkeypatch.delenv(packing.CHECK_VARLEN, raising=False)
    q, k, v = (torch.randn(12, heads, 64, dtype=torch.bfloat16) for heads in (4, 2, 2))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    first, _, _ = packing.check_packed_inputs(q, k, v, cu, cu, 7, 7, None, True)
    other_cu = cu.clone()
    again, mod_tensors, lengths = packing.check_packed_inputs(q, k, v, other_cu, other_cu, 7, 7, None, True)
    assert len(calls) == 1 and again is first and mod_tensors == score_mods.NO_TENSORS
    assert lengths.q is other_cu and lengths.k is other_cu
    other_calls = (  # checked in full once each, then known
        lambda: packing.check_packed_inputs(q, k, v, cu, cu, 8, 7, None, True),
        lambda: packing.check_packed_inputs(q, k, v, cu[:2], cu[:2], 7, 7, None, True),
        lambda: packing.check_packed_inputs(q, k, v, cu, cu, 7, 7, None, False),
        lambda: packing.check_packed_inputs(q, k, v, cu, cu, 7, 7, None, True, window_size=(4, 0)),
        lambda: packing.check_packed_inputs(q, k, v, cu, cu, 7, 7, None, True, sinks=torch.randn(4)),
    )
    never_known = (  # checked in full every time
        lambda: packing.check_packed_inputs(q, k, v, cu, cu, torch.tensor(7), 7, None, True),
        lambda: packing.check_packed_inputs(q, k, v, cu, cu, 7, 7, None, True, window_size=(4.0, 0)),
    )
    for expected, group in ((1, other_calls), (2, never_known)):
        for call in group:
            before = len(calls)
            call()
            call()
            assert len(calls) == before + expected
    sinks, slopes = torch.randn(4), torch.rand(2, 4)
    _, mod_tensors, _ = packing.check_packed_inputs(q, k, v, cu, cu, 7, 7, None, True, sinks=sinks)
    assert torch.equal(mod_tensors.sinks, sinks) and mod_tensors.slopes is None
    packing.check_packed_inputs(q, k, v, cu, cu, 7, 7, None, True, alibi_slopes=slopes)
    before = len(calls)
    _, mod_tensors, _ = packing.check_packed_inputs(q, k, v, cu, cu, 7, 7, None, True, alibi_slopes=slopes + 1)
    assert len(calls) == before and torch.equal(mod_tensors.slopes, slopes + 1)
    monkeypatch.setenv(packing.CHECK_VARLEN, "1")
    before = len(calls)
    packing.check_packed_inputs(q, k, v, cu, cu, 7, 7, None, True)
    packing.check_packed_inputs(q, k, v, cu, cu, 7, 7, None, True)
    assert len(calls) == before + 2


def _recorded_packed_call(monkeypatch):
    """(q, k, v, the packed arguments) of a packed batch of CPU tensors, the checks stood in for
    and the launches recorded (_RecordingLauncher.launches)."""
    from tilegym.ops.attention import api

    monkeypatch.setattr(launch, "_Launcher", _RecordingLauncher)
    monkeypatch.setattr(api, "check_packed_inputs", _checked_on_the_cpu)
    monkeypatch.setattr(launch, "compile_backward_ahead", lambda *args, **kwargs: None)
    _RecordingLauncher.launches = []
    q, k, v = (torch.randn(12, heads, 64, dtype=torch.bfloat16, requires_grad=True) for heads in (4, 2, 2))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    return q, k, v, {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 7, "max_seqlen_k": 7}


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "out-lse"])
@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_op_packed_api_returns_and_differentiates(monkeypatch, return_lse, training):
    """tile_fmha_functional on a packed batch of CPU tensors, its checks stood in for and its
    launches recorded: out (and lse) in the packed layout, new tensors; training runs the forward with the
    LSE and, on backward, the two-kernel backward, whose gradients reach q, k and v."""
    q, k, v, packed = _recorded_packed_call(monkeypatch)
    result = tile_fmha_functional(q, k, v, None, True, training, return_lse=return_lse, **packed)
    out, lse = result if return_lse else (result, None)
    assert out.shape == (12, 4, 64) and out._base is None
    assert lse is None or (lse.shape == (4, 12) and lse._base is None)
    assert (out.grad_fn is not None) == training
    if training:
        (out.float().sum() + (0 if lse is None else lse.sum())).backward()
        assert [tuple(t.grad.shape) for t in (q, k, v)] == [(12, 4, 64), (12, 2, 64), (12, 2, 64)]
    launched = [name for name, *_ in _RecordingLauncher.launches]
    forward = configs.FORWARD_LSE if training or return_lse else configs.FORWARD
    assert launched == [forward] + ([configs.BACKWARD_DQ, configs.BACKWARD_DKDV] if training else [])


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_op_packed_api_takes_score_functions(monkeypatch, training):
    """A packed tile_fmha_functional call with a score function takes the same path as without
    one, its launches running the kernels' copies with the function inlined (their keys carry its
    fingerprint) and the two-kernel backward; a learnable aux tensor gets its gradient."""
    from tilegym.ops.attention import score_functions as sf

    q, k, v, packed = _recorded_packed_call(monkeypatch)
    # inlined: as written, not as softcap= (predefined.py)
    out = tile_fmha_functional(q, k, v, None, True, training, **packed, **sf.inlined(sf.softcap(4.0)))
    assert out.shape == (12, 4, 64) and (out.grad_fn is not None) == training
    if training:
        out.float().sum().backward()
        assert [tuple(t.grad.shape) for t in (q, k, v)] == [(12, 4, 64), (12, 2, 64), (12, 2, 64)]
    launched = [name for name, *_ in _RecordingLauncher.launches]
    forward = configs.FORWARD_LSE if training else configs.FORWARD
    assert launched == [forward] + ([configs.BACKWARD_DQ, configs.BACKWARD_DKDV] if training else [])
    for name, kernel, *_ in _RecordingLauncher.launches:
        assert kernel is not VARIANTS[name].kernel, f"{name}: the plain kernel, not a copy with the function"
    if training:
        table = torch.randn(4, 9, requires_grad=True)
        out = tile_fmha_functional(q, k, v, None, True, True, **packed, **sf.relative_position_bias(table, 4))
        out.float().sum().backward()
        assert table.grad is not None and table.grad.shape == table.shape and table.grad.dtype == table.dtype


def _checked_on_the_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scaling, is_causal, *mods):
    """packing.check_packed_inputs of CPU tensors: the problem a CUDA call would get."""
    from tilegym.ops.attention.packing import CuSeqlens
    from tilegym.ops.attention.problem import Packing

    problem = problem_mod.AttentionProblem(
        cu_seqlens_q.numel() - 1, q.shape[1], k.shape[1], max_seqlen_q, max_seqlen_k, q.shape[2], q.dtype,
        1 / math.sqrt(q.shape[2]), is_causal, packing=Packing(q.shape[0], k.shape[0]),
    )  # fmt: skip
    return problem, score_mods.NO_TENSORS, CuSeqlens(cu_seqlens_q, cu_seqlens_k)


# ---- score functions under torch.compile ------------------------------------------------------


def _checked_dense_on_the_cpu(q, k, v, scaling, is_causal, *mods, **more):
    """problem.check_inputs of CPU tensors without modifiers: the problem a CUDA call would get."""
    batch, q_heads, seqlen_q, head_dim = q.shape
    problem = problem_mod.AttentionProblem(
        batch, q_heads, k.shape[1], seqlen_q, k.shape[2], head_dim, q.dtype, 1 / math.sqrt(head_dim), is_causal
    )  # fmt: skip
    return problem, score_mods.NO_TENSORS


def _relative_to_each_head(score, b, h, q_idx, kv_idx, aux):
    return score + ct_gather_stand_in(aux, h)


def ct_gather_stand_in(aux, h):  # never runs on the CPU: the kernels are recorded, not launched
    return aux[0][h]


def _relative_grad(grad, score, b, h, q_idx, kv_idx, aux, aux_grads):
    aux_grads[0][h] += grad


def test_op_score_functions_stay_in_one_compiled_graph(monkeypatch):
    """torch.compile(fullgraph=True) of a training step with score functions: the operators take
    them by key, the forward and backward launch the kernels' copies with them inlined, and a
    learnable aux tensor gets its gradient; another closure of the same code (another softcap)
    traces again and runs its own kernels, as does a module-level function."""
    from tilegym.ops.attention import custom_ops
    from tilegym.ops.attention import score_functions as sf

    monkeypatch.setattr(launch, "_Launcher", _RecordingLauncher)
    monkeypatch.setattr(launch, "compile_backward_ahead", lambda *args, **kwargs: None)
    monkeypatch.setattr(custom_ops, "check_inputs", _checked_dense_on_the_cpu)
    torch._dynamo.reset()
    q, k, v = (t.requires_grad_() for t in _cpu_inputs())

    def step(q, k, v, functions):
        return tile_fmha_with_backward(q, k, v, is_causal=True, **functions).float().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    kernels_of = {}
    table = torch.randn(4, requires_grad=True)
    learned = {"score_mod": _relative_to_each_head, "score_mod_grad": sf.additive_grad, "aux": (table,),
               "aux_grad": _relative_grad}  # fmt: skip
    cap3, cap4 = sf.inlined(sf.softcap(3.0)), sf.inlined(sf.softcap(4.0))  # as written, not as softcap=
    for name, functions in (("cap3", cap3), ("cap4", cap4), ("learned", learned)):
        _RecordingLauncher.launches = []
        compiled(q, k, v, functions).backward()
        launched = {launch_name: kernel for launch_name, kernel, *_ in _RecordingLauncher.launches}
        assert list(launched) == [configs.FORWARD_LSE, configs.BACKWARD_DQ, configs.BACKWARD_DKDV], name
        for launch_name, kernel in launched.items():
            assert kernel is not VARIANTS[launch_name].kernel, f"{name} {launch_name}: not the copy with functions"
        kernels_of[name] = launched[configs.BACKWARD_DKDV]
    assert len(set(kernels_of.values())) == 3, "each set of functions runs kernels of its own"
    assert table.grad is not None and table.grad.shape == table.shape


def test_op_packed_score_functions_stay_in_one_compiled_graph(monkeypatch):
    """The same for a packed batch: the packed operators take the functions' key, and a learnable
    aux tensor gets its gradient."""
    from tilegym.ops.attention import custom_ops
    from tilegym.ops.attention import score_functions as sf

    q, k, v, packed = _recorded_packed_call(monkeypatch)
    monkeypatch.setattr(custom_ops, "check_packed_inputs", _checked_on_the_cpu)
    torch._dynamo.reset()
    table = torch.randn(4, 9, requires_grad=True)

    def step(q, k, v, relative):
        return tile_fmha_functional(q, k, v, None, True, True, **packed, **relative).float().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled(q, k, v, sf.relative_position_bias(table, 4)).backward()
    launched = [(name, kernel) for name, kernel, *_ in _RecordingLauncher.launches]
    assert [name for name, _ in launched] == [configs.FORWARD_LSE, configs.BACKWARD_DQ, configs.BACKWARD_DKDV]
    assert all(kernel is not VARIANTS[name].kernel for name, kernel in launched)
    assert table.grad is not None and table.grad.shape == table.shape
    assert [tuple(t.grad.shape) for t in (q, k, v)] == [(12, 4, 64), (12, 2, 64), (12, 2, 64)]


def _dropout_arguments(launched) -> list:
    """(name, dropout switch, its seed tensor) of each recorded launch."""
    found = []
    for name, kernel, _, args, _ in launched:
        names = launching.parameter_names(kernel)
        given = dict(zip(names, args, strict=True))
        found.append((name, given["dropout"], given["DropoutSeed"]))
    return found


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_op_dropout_reaches_the_kernels(monkeypatch, packed, compiled):
    """A training step with dropout, eager and under torch.compile(fullgraph=True) (the seed then
    drawn in the graph): the forward and the backward's kernels get the switch and one seed,
    a new seed per run, and no dropout reaches a call without it."""
    from tilegym.ops.attention import api, custom_ops

    if packed:
        q, k, v, packing = _recorded_packed_call(monkeypatch)
        monkeypatch.setattr(custom_ops, "check_packed_inputs", _checked_on_the_cpu)
    else:
        monkeypatch.setattr(launch, "_Launcher", _RecordingLauncher)
        monkeypatch.setattr(launch, "compile_backward_ahead", lambda *args, **kwargs: None)
        monkeypatch.setattr(custom_ops, "check_inputs", _checked_dense_on_the_cpu)
        monkeypatch.setattr(api, "check_inputs", _checked_dense_on_the_cpu)
        q, k, v = (t.requires_grad_() for t in _cpu_inputs())
        packing = {}
    torch._dynamo.reset()

    def step(q, k, v, rate):
        return tile_fmha_functional(q, k, v, None, True, True, dropout_p=rate, **packing).float().sum()

    run = torch.compile(step, fullgraph=True, backend="aot_eager") if compiled else step
    seeds = []
    for rate in (0.25, 0.25, 0.0):
        _RecordingLauncher.launches = []
        run(q, k, v, rate).backward()
        found = _dropout_arguments(_RecordingLauncher.launches)
        assert [name for name, *_ in found] == [configs.FORWARD_LSE, configs.BACKWARD_DQ, configs.BACKWARD_DKDV]
        assert all(on == bool(rate) for _, on, _ in found), rate
        if rate:
            first = found[0][2]
            assert first.dtype == torch.int32 and tuple(first.shape) == (4,)
            assert all(torch.equal(seed, first) for _, _, seed in found), "the backward reuses the forward's seed"
            seeds.append(first.clone())
    assert not torch.equal(*seeds), "each run draws a new seed"


def test_op_dropout_rates_and_their_scale():
    """The rate is rounded to a multiple of 2^-16; the kept probabilities' scale is the exact
    inverse of the keep probability, at most 2^15 (a float16 one stays finite); a rate above
    1 - 2^-15 is refused naming dropout_p."""
    from tilegym.ops.attention import dropout

    assert dropout.threshold(0.1) == 6554 and dropout.kept_scale(0.1) == 65536 / (65536 - 6554)
    assert dropout.check_rate(dropout.max_rate()) == dropout.max_rate() == 1 - 2**-15
    assert dropout.kept_scale(dropout.max_rate()) == 2**15
    for rate in (dropout.max_rate() + 2**-16, 0.99999):
        with pytest.raises(ValueError, match="dropout_p must be at most"):
            dropout.check_rate(rate)


def test_op_dropout_seeds_and_first_rows():
    """A new seed: two drawn words, then first row 0 and a zero; drawn_as gives every call within
    it one seed (restored on the way out); with_first_row's seed draws those rows of the whole
    mask; a seed of another shape is refused."""
    from tilegym.ops.attention import dropout
    from tilegym.ops.attention.reference import dropout_kept

    seed = dropout.new_seed(torch.device("cpu"))
    assert seed.dtype == torch.int32 and tuple(seed.shape) == (4,) and seed[2:].tolist() == [0, 0]
    assert 0 <= seed.min().item() and seed.max().item() < 2**31
    given = torch.tensor([5, 6, 0, 0], dtype=torch.int32)
    with dropout.drawn_as(given):
        assert dropout.call_seed(torch.device("cpu")) is given
        with dropout.drawn_as(dropout.with_first_row(given, 3)):
            assert dropout.call_seed(torch.device("cpu")).tolist() == [5, 6, 3, 0]
        assert dropout.call_seed(torch.device("cpu")) is given
    assert dropout.call_seed(torch.device("cpu")) is not given and given.tolist() == [5, 6, 0, 0]
    whole = dropout_kept(given, 0.4, 2, 3, 120, 90)
    rows = dropout_kept(dropout.with_first_row(given, 37), 0.4, 2, 3, 50, 90)
    assert torch.equal(rows, whole[:, :, 37:87])
    with pytest.raises(ValueError, match="dropout_seed must be an int32 tensor of shape"):
        dropout.check_seed(given[:2], torch.device("cpu"))


def test_op_dropout_masks_look_random():
    """The kernels' mask, as reference.dropout_kept computes it: the kept share of the whole and
    of rows and columns as a binomial's, no correlation between neighbours (keys j and j + 8
    share a hash), and heads, sequences and seeds each with a mask of their own."""
    from tilegym.ops.attention.reference import dropout_kept

    rate, heads, size = 0.3, 4, 512
    seed = torch.tensor([123456789, 987654321, 0, 0], dtype=torch.int32)
    kept = dropout_kept(seed, rate, 2, heads, size, size).double()  # [2, heads, size, size]
    assert abs(kept.mean().item() - (1 - rate)) < 5 * math.sqrt(rate * (1 - rate) / kept.numel())
    for axis in (-1, -2):
        z = (kept.mean(axis) - (1 - rate)) / math.sqrt(rate * (1 - rate) / size)
        assert 0.85 < z.std().item() < 1.15, axis
    centred = kept - kept.mean()
    variance = (centred * centred).mean()
    neighbours = {
        "key + 1": (centred[..., 1:], centred[..., :-1]),
        "key + 8 (one hash)": (centred[..., 8:], centred[..., :-8]),
        "key + 16": (centred[..., 16:], centred[..., :-16]),
        "row + 1": (centred[..., 1:, :], centred[..., :-1, :]),
        "diagonal": (centred[..., 1:, 1:], centred[..., :-1, :-1]),
        "next head": (centred[:, 1:], centred[:, :-1]),
        "next sequence": (centred[1:], centred[:-1]),
    }
    for name, (a, b) in neighbours.items():
        assert abs(((a * b).mean() / variance).item()) < 0.01, name
    other_seed = dropout_kept(seed + torch.tensor([1, 1, 0, 0], dtype=torch.int32), rate, 2, heads, size, size).double()
    assert abs((((other_seed - other_seed.mean()) * centred).mean() / variance).item()) < 0.01


def test_op_closures_run_at_a_graph_break_under_torch_compile():
    """torch.compile's guards tell functions apart by their code object alone, so only functions
    that close over nothing pass through the operators by key (the ready-made ones are such
    copies, a code object each); a closure, or a block mask, takes the eager call at a graph
    break, where the functions are read afresh."""
    from tilegym.ops.attention import api
    from tilegym.ops.attention import score_functions as sf
    from tilegym.ops.attention.caller_functions import CallerFunctions

    def calls(functions, block_mask=None):
        return CallerFunctions.of(
            functions.get("score_mod"), functions.get("score_mod_grad"), None, functions.get("aux_grad"),
            functions.get("mask_mod"), None, block_mask,
        )  # fmt: skip

    def closure_over(cap):
        def capped(score, b, h, q_idx, kv_idx, aux):
            return score * cap

        return {"score_mod": capped, "score_mod_grad": sf.additive_grad}

    assert api._operator_takes(None)
    for functions in (sf.softcap(3.0), sf.relative_position_bias(torch.zeros(2, 9), 4), sf.prefix_lm(None),
                      sf.sliding_window_with_globals(8, 2), {"score_mod": _relative_to_each_head}):  # fmt: skip
        assert api._operator_takes(calls(functions)), functions
    assert not api._operator_takes(calls(closure_over(3.0)))
    assert not api._operator_takes(calls(sf.softcap(3.0), block_mask=object()))
    first, second = sf.softcap(3.0)["score_mod"], sf.softcap(5.0)["score_mod"]
    assert first.__code__ is not second.__code__, "copies of one template keep code objects of their own"
