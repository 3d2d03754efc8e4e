"""CPU tests of the config comparison's helpers: config parsing and the one-config patch."""

import argparse

import pytest

from tests.benchmark import compare_configs
from tilegym import autotune
from tilegym.autotune import TileConfig
from tilegym.ops.attention import configs


def test_compare_configs_parses_and_labels_configs():
    config = compare_configs.parse_config("64,128,8")
    assert config == TileConfig(64, 128, num_worker_warps=8)
    assert compare_configs.label(config) == "64,128,8"
    assert compare_configs.parse_config("128,128,8,2,2") == TileConfig(128, 128, 8, 2, 2)
    with pytest.raises(argparse.ArgumentTypeError):
        compare_configs.parse_config("1,2,3,4,5,6")


def test_compare_configs_patch_leaves_one_config_to_one_kernel():
    forced = TileConfig(32, 32)
    with compare_configs.only(configs.FORWARD_LSE, forced):
        assert autotune.forced_candidates(configs.FORWARD_LSE) == (forced,)
        assert autotune.forced_candidates(configs.BACKWARD_DQ) is None
    assert autotune.forced_candidates(configs.FORWARD_LSE) is None
