import contextlib
import os
import zlib

import pytest
import torch

# Op tests use each table's first config: they check results, not speed, and run fast.
# TILEGYM_TEST_AUTOTUNE=1 keeps tuning on, to check the tuned configs too.
if os.environ.get("TILEGYM_TEST_AUTOTUNE", "") not in ("1", "true", "yes", "on"):
    os.environ["DISABLE_AUTOTUNE"] = "1"


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    """Fresh random inputs in every test, reproducible from the test's name."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def force_config():
    """force_config(kernel name, config): launches of that kernel use the config, tuning aside,
    until the test ends (autotune.force_config)."""
    from tilegym import autotune

    with contextlib.ExitStack() as stack:
        yield lambda kernel_name, config: stack.enter_context(autotune.force_config(kernel_name, config))


def pytest_collection_modifyitems(config, items):
    """TILEGYM_TEST_SHARD=i/n keeps every n-th test starting at i, so n processes can share
    one GPU and compile kernels in parallel: for i in 0 1 2 3; do ... i/4 & done; wait."""
    shard = os.environ.get("TILEGYM_TEST_SHARD")
    if not shard:
        return
    index, count = (int(part) for part in shard.split("/"))
    if not 0 <= index < count:
        raise ValueError(f"TILEGYM_TEST_SHARD must be i/n with 0 <= i < n, got {shard!r}")
    config.hook.pytest_deselected(items=[item for position, item in enumerate(items) if position % count != index])
    items[:] = items[index::count]
