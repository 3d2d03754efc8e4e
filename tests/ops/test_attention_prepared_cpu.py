"""Prepared launches (tilegym/ops/attention/prepared.py) on the CPU: cuTile's launch and the GPU's
facts stubbed, so that a replayed call can be compared launch by launch with the launch path."""

import math

import cuda.tile as ct
import pytest
import torch

from tilegym import autotune, cuda_context, launching
from tilegym.ops.attention import configs, launch, prepared
from tilegym.ops.attention.packing import CuSeqlens
from tilegym.ops.attention.problem import AttentionProblem, Packing
from tilegym.ops.attention.score_mods import NO_TENSORS, PLAIN, ModTensors, ScoreMods


@pytest.fixture
def launches(monkeypatch):
    """The launches made, as (grid, kernel, arguments); the launch path's decisions as on an H100,
    each kernel's first config; no plans or choices from elsewhere."""
    made = []
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    monkeypatch.delenv("TILEGYM_BACKWARD", raising=False)
    monkeypatch.setattr(launching, "device_facts", lambda index: ("NVIDIA H100 80GB HBM3", "sm_90", ct.__version__))
    monkeypatch.setattr(launching, "current_stream_handle", lambda index: 0)
    monkeypatch.setattr(cuda_context, "ensure_current", lambda index: None)
    monkeypatch.setattr(ct, "launch", lambda stream, grid, kernel, arguments: made.append((grid, kernel, arguments)))
    monkeypatch.setattr(prepared, "_plans", {})
    monkeypatch.setattr(autotune, "_chosen", {})
    return made


def _problem(seqlen=1024, head_dim=128, causal=True, kv_heads=16, mods=PLAIN, packing=None, batch=2):
    return AttentionProblem(
        batch, 16, kv_heads, seqlen, seqlen, head_dim, torch.bfloat16, head_dim**-0.5, causal, mods, packing=packing
    )  # fmt: skip


class _Call:
    """One training call's tensors (small: the stubbed launch reads none), given to the launch
    path explicitly, so that only its workspaces are made inside it."""

    def __init__(
        self, problem: AttentionProblem, mod_tensors=NO_TENSORS, cu_seqlens=None, same_k_and_v=False, row_grads=False
    ):
        d = problem.head_dim
        self.q, self.k, self.v = (torch.randn(1, 16, 8, d, dtype=torch.bfloat16) for _ in range(3))
        if same_k_and_v:
            self.v = self.k
        self.out, self.d_out = torch.randn_like(self.q), torch.randn_like(self.q)
        self.lse = torch.randn(1, 16, 8)
        self.grads = tuple(torch.empty_like(t) for t in (self.q, self.k, self.v))
        self.problem, self.mod_tensors, self.cu_seqlens = problem, mod_tensors, cu_seqlens
        # With row_grads, the LSE's gradient (fp32: the kernels read it as it is) and the sinks'.
        self.d_lse = torch.randn(1, 16, 8) if row_grads else None
        self.sinks_grad = row_grads

    def run(self) -> launch.Gradients:
        launch.forward(
            self.q, self.k, self.v, self.problem, True, self.out, self.lse, self.mod_tensors, self.cu_seqlens
        )  # fmt: skip
        return launch.backward(
            self.d_out, self.q, self.k, self.v, self.out, self.lse, self.problem, self.grads, self.mod_tensors,
            d_lse=self.d_lse, sinks_grad=self.sinks_grad, cu_seqlens=self.cu_seqlens,
        )  # fmt: skip

    def labels(self, made) -> list:
        """The launches with each tensor argument by what it is: one of this call's tensors by
        name, a placeholder, or a workspace by its layout (made afresh for each call)."""
        names = {id(t): name for name, t in vars(self).items() if isinstance(t, torch.Tensor)}
        names.update({id(t): f"grad{i}" for i, t in enumerate(self.grads)})
        for name, tensor in (("sinks", self.mod_tensors.sinks), ("slopes", self.mod_tensors.slopes)):
            if tensor is not None:
                names[id(tensor)] = name
        if self.cu_seqlens is not None:
            names.update({id(self.cu_seqlens.q): "cu_q", id(self.cu_seqlens.k): "cu_k"})

        def label(argument):
            if not isinstance(argument, torch.Tensor):
                return argument
            if id(argument) in names:
                return names[id(argument)]
            if id(argument) in launch._PLACEHOLDERS:
                return ("placeholder", id(argument))
            layout = ("workspace", tuple(argument.shape), argument.stride(), argument.dtype)
            # The fused backward's sums must be zero at its launch (the launch path's reset).
            return (*layout, bool((argument == 0).all())) if argument.dim() == 4 else layout

        return [(grid, kernel, [label(a) for a in arguments]) for grid, kernel, arguments in made]


@pytest.fixture
def launch_path_calls(monkeypatch):
    """How often the launch path ran the forward's and the backward's host work; workspaces a
    plan makes are poisoned (NaN), so that a sum it fails to zero shows."""
    calls = []
    for name in ("_positive_scale", "_backward_steps"):
        original = getattr(launch, name)
        monkeypatch.setattr(launch, name, lambda *args, _name=name, _f=original: calls.append(_name) or _f(*args))
    empty_strided = torch.empty_strided
    monkeypatch.setattr(torch, "empty_strided", lambda *args, **kwargs: empty_strided(*args, **kwargs).fill_(math.nan))
    return calls


def _sinks_and_slopes():
    """Sinks (taking no gradient) and ALiBi slopes per batch entry and head."""
    return ScoreMods(sinks=True, alibi=True), ModTensors(sinks=torch.randn(16), slopes=torch.rand(2, 16))


CASES = {
    "two-kernel backward": lambda: (_problem(), ModTensors(), None),
    "fused backward": lambda: (_problem(seqlen=4096), ModTensors(), None),
    "grouped fused backward": lambda: (_problem(seqlen=4096, kv_heads=2), ModTensors(), None),
    "D=64 without a mask": lambda: (_problem(head_dim=64, causal=False), ModTensors(), None),
    "sinks and ALiBi": lambda: (_problem(seqlen=4096, mods=_sinks_and_slopes()[0]), *_sinks_and_slopes()[1:], None),
    "packed": lambda: (
        _problem(seqlen=3000, packing=Packing(5000, 5000)),
        ModTensors(),
        CuSeqlens(torch.tensor([0, 3000, 5000], dtype=torch.int32), torch.tensor([0, 3000, 5000], dtype=torch.int32)),
    ),
    "packed, one tensor of lengths": lambda: (
        _problem(seqlen=3000, packing=Packing(5000, 5000)),
        ModTensors(),
        _shared_lengths(torch.tensor([0, 3000, 5000], dtype=torch.int32)),
    ),
}


def _shared_lengths(lengths: torch.Tensor) -> CuSeqlens:
    """Self-attention's usual call: one tensor as both cumulative lengths."""
    return CuSeqlens(lengths, lengths)


@pytest.mark.parametrize("case", CASES)
def test_op_prepared_launches_are_the_launch_paths(launches, launch_path_calls, case):
    """A call of a problem seen before launches, from its plans, the kernels, grids and arguments
    the launch path gives it, its own tensors in their places, without running the launch path."""
    problem, mod_tensors, cu_seqlens = CASES[case]()
    _Call(problem, mod_tensors, cu_seqlens).run()  # prepares
    assert len(prepared._plans) == 2 and launch_path_calls == ["_positive_scale", "_backward_steps"]
    second = _Call(problem, mod_tensors, cu_seqlens)
    launches.clear()
    launch_path_calls.clear()
    second.run()
    replayed = second.labels(launches)
    assert not launch_path_calls, "a prepared call ran the launch path"

    prepared._plans.clear()
    launches.clear()
    second.run()
    assert launch_path_calls == ["_positive_scale", "_backward_steps"]
    assert replayed == second.labels(launches)
    assert len(replayed) >= 3 and any(label == "q" for _, _, arguments in replayed for label in arguments)


@pytest.mark.parametrize("seqlen", [1024, 4096], ids=["two-kernel backward", "fused backward"])
def test_op_prepared_launches_with_the_row_gradients(launches, launch_path_calls, monkeypatch, seqlen):
    """With the LSE's and the sinks' gradients a call is prepared too: its d_lse reaches the
    kernels, and the sinks' shares, new for each call, are zeroed before the launch that writes
    them and summed into the sinks' gradient (workspaces are made NaN here: unzeroed shares
    would give a NaN gradient)."""
    mods, mod_tensors = ScoreMods(sinks=True), ModTensors(sinks=torch.randn(16))
    problem = _problem(seqlen=seqlen, mods=mods)
    tiles = math.ceil(seqlen / 64)  # the shares' query tiles: the smallest candidate's
    stubbed = ct.launch

    def adding_ones_to_the_shares(stream, grid, kernel, arguments):
        for argument in arguments:
            if isinstance(argument, torch.Tensor) and argument.shape == (2, 16, tiles):
                argument.add_(1)  # as a kernel writes its shares, after the zeroing
        stubbed(stream, grid, kernel, arguments)

    monkeypatch.setattr(ct, "launch", adding_ones_to_the_shares)
    assert (_Call(problem, mod_tensors, row_grads=True).run().d_sinks == 2 * tiles).all()
    assert len(prepared._plans) == 2
    second = _Call(problem, mod_tensors, row_grads=True)
    launches.clear()
    launch_path_calls.clear()
    d_sinks = second.run().d_sinks
    replayed = second.labels(launches)
    assert not launch_path_calls, "a prepared call ran the launch path"
    # Each share written once after its zeroing, by the launch the gradient is summed from.
    assert d_sinks.shape == (16,) and (d_sinks == 2 * tiles).all()

    prepared._plans.clear()
    launches.clear()
    second.run()
    assert replayed == second.labels(launches)
    assert any(label == "d_lse" for _, _, arguments in replayed for label in arguments)
    # Without them, the same problem's backward has a plan of its own (its forward shares one).
    launches.clear()
    _Call(problem, mod_tensors).run()
    assert len(prepared._plans) == 3


def test_op_no_plan_where_two_roles_share_a_tensor(launches):
    """A call whose k is its v prepares nothing: a later call's own k and v reach their places."""
    problem = _problem()
    _Call(problem, same_k_and_v=True).run()
    assert not prepared._plans
    call = _Call(problem)
    launches.clear()
    call.run()
    names = [label for _, _, arguments in call.labels(launches) for label in arguments]
    assert "k" in names and "v" in names


def test_op_shared_and_separate_lengths_keep_plans_apart(launches):
    """A plan made where one tensor was both cumulative lengths is not replayed for a call with
    two (its key lengths reach CuSeqlensK), nor the other way round; each replays its own."""
    problem = _problem(seqlen=3000, packing=Packing(5000, 5000))

    def lengths():
        return torch.tensor([0, 3000, 5000], dtype=torch.int32)

    def shared():
        return _shared_lengths(lengths())

    def separate():
        return CuSeqlens(lengths(), lengths())

    for first, second in ((shared, separate), (separate, shared)):
        prepared._plans.clear()
        _Call(problem, cu_seqlens=first()).run()
        assert len(prepared._plans) == 2
        for _ in range(2):  # the first call of the other kind prepares, the second replays
            call = _Call(problem, cu_seqlens=second())
            launches.clear()
            call.run()
            names = {label for _, _, arguments in call.labels(launches) for label in arguments}
            # One shared tensor is labelled cu_k (labels names q's lengths first, then k's).
            assert "cu_k" in names and ("cu_q" in names) == (second is separate)
        assert len(prepared._plans) == 4


def test_op_plans_follow_the_settings(launches, monkeypatch):
    """TILEGYM_BACKWARD set after a plan was made: the next call takes the launch path and its choice."""
    problem = _problem(seqlen=4096)
    _Call(problem).run()
    _Call(problem).run()
    fused_kernel = launches[-1][1]
    monkeypatch.setenv("TILEGYM_BACKWARD", "two-kernel")
    launches.clear()
    _Call(problem).run()
    assert len(launches) == 3 and fused_kernel not in [kernel for _, kernel, _ in launches]


def test_op_plans_follow_forced_configs(launches):
    """A plan does not outlive its choice: under force_config the forward takes the forced tiles."""
    problem = _problem(seqlen=4096)
    _Call(problem).run()
    forced = autotune.TileConfig(64, 64, num_worker_warps=4)
    name = configs.FORWARD_LSE_FIXED_MAX
    with autotune.force_config(name, forced):
        launches.clear()
        _Call(problem).run()
        assert launches[0][0] == (math.ceil(4096 / 64), 16, 2)
    launches.clear()
    _Call(problem).run()
    assert launches[0][0] != (math.ceil(4096 / 64), 16, 2)
