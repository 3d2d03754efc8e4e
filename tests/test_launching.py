"""Launch helpers every operator shares: arguments by parameter name, split floats."""

import cuda.tile as ct
import pytest

from tilegym import launching
from tilegym.kernel_cache import CachedKernel
from tilegym.ops.attention.variants import VARIANTS


@CachedKernel
def _kernel(X, Y, scale: float, scale_lo: float, block: ct.Constant[int]):
    ct.store(Y, index=(ct.bid(0),), tile=ct.load(X, index=(ct.bid(0),), shape=(block,)) * scale)


def test_arguments_follow_the_kernels_parameter_order():
    values = {"block": 64, "Y": "y", "X": "x", **launching.split_arguments(scale=0.1)}
    assert launching.NamedArguments(_kernel, values)() == ("x", "y", *launching.split_float(0.1), 64)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"X": 1, "Y": 2, "scale": 0.5, "scale_lo": 0.0}, r"missing arguments \['block'\]"),
        ({"X": 1, "Y": 2, "scale": 0.5, "scale_lo": 0.0, "block": 4, "Z": 3}, r"unknown arguments \['Z'\]"),
        (
            {"X": 1, "Y": 2, "scale": 0.5, "scal_lo": 0.0, "block": 4},
            r"missing arguments \['scale_lo'\], unknown arguments \['scal_lo'\]",
        ),
    ],
    ids=["missing", "unknown", "misspelt"],
)
def test_an_argument_missing_or_unknown_is_refused(values, message):
    with pytest.raises(TypeError, match=message):
        launching.NamedArguments(_kernel, values)


def test_split_floats_add_up_to_the_value():
    for value in (0.1, 1 / 3, -2.5e-7, 1e30):
        hi, lo = launching.split_float(value)
        assert abs((hi + lo) - value) <= abs(value) * 2.0**-46


def test_every_variant_pins_only_parameters_its_kernel_has():
    for name, variant in VARIANTS.items():
        parameters = launching.parameter_names(variant.kernel)
        assert set(variant.fixed) <= set(parameters), name
        assert variant.tiles in ("query", "key") and variant.heads in ("query", "kv"), name


def test_late_arguments_are_given_at_each_call():
    named = launching.NamedArguments(_kernel, {"X": "x", "Y": "y", "scale": 0.5, "scale_lo": 0.0}, late=("block",))
    assert named(block=64) == ("x", "y", 0.5, 0.0, 64)
    assert named(block=32)[-1] == 32
    with pytest.raises(TypeError, match=r"missing arguments \['block'\]"):
        launching.NamedArguments(_kernel, {"X": "x", "Y": "y", "scale": 0.5, "scale_lo": 0.0})
