import os
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))  # tests/distributed.py and scripts run under torchrun


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        keep_cpu_shims_apart(items)
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords or "vllm" in item.keywords:
            item.add_marker(skip_gpu)


def keep_cpu_shims_apart(items) -> None:
    """A test taking a `groups` fixture builds megatron on CPU, whose shims (parallel/cpu.py) stay installed
    for the rest of the pytest process and break CUDA tests after it (`Expected a 'cpu' device type for
    generator`). Where a run on a CUDA machine collects both, the shim tests are skipped, saying so."""
    if not any("gpu" in item.keywords for item in items):
        return
    skip = pytest.mark.skip(
        reason="installs megatron's CPU shims for the whole process (parallel/cpu.py), which would break "
        "this run's CUDA tests: run it in a pytest process of its own (e.g. -m 'not gpu')"
    )
    for item in items:
        if "groups" in getattr(item, "fixturenames", ()) and "gpu" not in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gloo_world():
    """torch.distributed on gloo in this process, world size 1, for code that runs collectives over the
    group it is given (yields `dist.group.WORLD`); torn down after the test."""
    import torch.distributed as dist

    from parallel.launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def groups():
    """The engine's process groups (`parallel.state.init_distributed`) for a world of one on gloo, shared by a
    test module; torn down after it, with the environment put back: init_distributed exports MASTER_PORT & co,
    and later `engine.train` subprocesses of the test run must not inherit them (test_train_e2e then failed
    with EADDRINUSE). A module that needs more set-up defines its own `groups`."""
    from parallel.dims import ParallelDims
    from parallel.state import destroy_distributed, init_distributed

    saved = dict(os.environ)
    groups = init_distributed(ParallelDims(world_size=1), "cpu", seed=3)
    yield groups
    destroy_distributed()
    os.environ.clear()
    os.environ.update(saved)
