"""CPU tests of the config comparison's helpers: config parsing and the one-config patch."""

import argparse

import pytest

from tests.benchmark import compare_configs
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
    other = configs.candidates(configs.BACKWARD_DQ, "sm_90", 128, 2)
    with compare_configs.only(configs.FORWARD_LSE, forced):
        assert configs.candidates(configs.FORWARD_LSE, "sm_90", 128, 2) == (forced,)
        assert configs.candidates(configs.BACKWARD_DQ, "sm_90", 128, 2) == other
    assert configs.candidates(configs.FORWARD_LSE, "sm_90", 128, 2) != (forced,)
