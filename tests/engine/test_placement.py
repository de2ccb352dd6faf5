"""One device per DP rank (engine/placement.py), without a GPU: which device each local rank
gets, the start-up refusals (in EngineConfig.create, in the clients before anything is bound or
spawned, and in the rank itself), and the torch.distributed backend chosen from the device."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from engine.config import EngineConfig
from engine.dp import client as dp_client
from engine.dp.async_client import AsyncEngineClient
from engine.dp.headless import run_headless
from engine.placement import (check_device_name, check_placement, process_group_backend, rank_device,
                                 visible_cuda_devices)
from engine.dp.rank import place_rank


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n): torch reports n visible CUDA devices (0: CUDA not available)."""
    def set_count(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return set_count


# -- rank_device: every combination ---------------------------------------------------------------

@pytest.mark.parametrize("local_ranks,visible", [(l, v) for l in range(1, 9) for v in range(0, 9)])
def test_cuda_gives_each_local_rank_its_own_visible_device(local_ranks, visible):
    if local_ranks > visible:
        with pytest.raises(ValueError, match="--data-parallel-size-local" if visible else "no CUDA device"):
            rank_device("cuda", 0, local_ranks, visible)
        return
    devices = [rank_device("cuda", l, local_ranks, visible) for l in range(local_ranks)]
    assert devices == [f"cuda:{l}" for l in range(local_ranks)]
    assert len(set(devices)) == local_ranks  # never two local ranks on one GPU


@pytest.mark.parametrize("local_ranks,visible", itertools.product(range(1, 5), range(0, 5)))
def test_cpu_puts_every_rank_on_the_cpu_whatever_is_visible(local_ranks, visible):
    assert [rank_device("cpu", l, local_ranks, visible) for l in range(local_ranks)] == ["cpu"] * local_ranks


@pytest.mark.parametrize("index,visible", [(i, v) for i in range(4) for v in range(1, 5)])
def test_explicit_cuda_index_for_one_local_rank(index, visible):
    if index >= visible:
        with pytest.raises(ValueError, match=f"--device cuda:{index}: only {visible} CUDA device"):
            rank_device(f"cuda:{index}", 0, 1, visible)
    else:
        assert rank_device(f"cuda:{index}", 0, 1, visible) == f"cuda:{index}"


@pytest.mark.parametrize("local_ranks", [2, 3, 8])
def test_explicit_cuda_index_is_refused_for_several_local_ranks(local_ranks):
    with pytest.raises(ValueError, match=rf"--device cuda:1 would put all {local_ranks} local ranks .*"
                                         rf"--data-parallel-size-local {local_ranks}\) on one GPU"):
        rank_device("cuda:1", 0, local_ranks, 8)


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_no_visible_gpu_is_refused(device):
    with pytest.raises(ValueError, match="no CUDA device is visible.*CUDA_VISIBLE_DEVICES"):
        check_placement(device, 1, 0)


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:-1", "CUDA", "cuda:1:2", "mps", "cpu:0", ""])
def test_bad_device_spelling_is_refused(device):
    with pytest.raises(ValueError, match="--device: must be cpu, cuda or cuda:N"):
        check_device_name(device)
    with pytest.raises(ValueError, match="--device"):
        rank_device(device, 0, 1, 4)


@pytest.mark.parametrize("local_rank,local_ranks", [(-1, 2), (2, 2), (0, 0)])
def test_local_rank_out_of_range_is_refused(local_rank, local_ranks):
    with pytest.raises(ValueError, match="local rank|--data-parallel-size-local"):
        rank_device("cuda", local_rank, local_ranks, 8)


# -- process group backend ---------------------------------------------------------------------

@pytest.mark.parametrize("device,backend", [("cpu", "gloo"), ("cuda", "nccl"), ("cuda:0", "nccl"),
                                            ("cuda:7", "nccl")])
def test_backend_follows_the_device(device, backend):
    assert process_group_backend(device) == backend


def test_backend_of_a_bad_device_is_refused():
    with pytest.raises(ValueError, match="--device"):
        process_group_backend("xpu")


# -- torch's view, the config, the rank ----------------------------------------------------------

def test_visible_devices_respect_cuda_availability(gpus):
    gpus(0)
    assert visible_cuda_devices() == 0
    gpus(3)
    assert visible_cuda_devices() == 3


@pytest.fixture(scope="module")
def cpu_config(checkpoint):
    return EngineConfig.create(checkpoint("tiny-mixtral"), max_model_len=64, num_gpu_blocks=8,
                               data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2, dtype="float32")


def test_config_refuses_more_local_ranks_than_gpus(checkpoint, gpus):
    gpus(1)
    with pytest.raises(ValueError, match="--data-parallel-size-local 2 needs one GPU per local rank, but only 1"):
        EngineConfig.create(checkpoint("tiny-mixtral"), max_model_len=64, num_gpu_blocks=8, device="cuda",
                            data_parallel_size=2, dtype="float32")
    gpus(2)
    config = EngineConfig.create(checkpoint("tiny-mixtral"), max_model_len=64, num_gpu_blocks=8, device="cuda",
                                 data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2, dtype="float32")
    assert config.device == "cuda"
    with pytest.raises(ValueError, match="--device: must be cpu, cuda or cuda:N"):
        EngineConfig.create(checkpoint("tiny-mixtral"), max_model_len=64, num_gpu_blocks=8, device="tpu", dtype="float32")


def test_rank_gets_the_device_of_its_local_index(cpu_config, gpus):
    gpus(2)
    config = dataclasses.replace(cpu_config, device="cuda")  # ranks 2 and 3 of 4 run on this node
    placed = [place_rank(config, rank) for rank in (2, 3)]
    assert [c.device for c in placed] == ["cuda:0", "cuda:1"]
    assert [c.parallel.data_parallel_rank for c in placed] == [2, 3]
    assert config.device == "cuda" and config.parallel.data_parallel_rank == 0  # not mutated
    assert [place_rank(cpu_config, rank).device for rank in (2, 3)] == ["cpu", "cpu"]
    gpus(1)
    with pytest.raises(ValueError, match="--data-parallel-size-local 2"):
        place_rank(config, 3)  # the rank refuses too (reported to the front end as RankFailed)


# -- the clients refuse before binding or spawning anything ----------------------------------------

@pytest.fixture
def no_spawn(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a rank was spawned or a socket bound for a refused placement")
    monkeypatch.setattr(dp_client.mp, "get_context", forbidden)
    monkeypatch.setattr(dp_client.zmq, "Context", forbidden)


@pytest.mark.parametrize("visible,device,match", [
    (1, "cuda", "--data-parallel-size-local 2 needs one GPU per local rank, but only 1"),
    (0, "cuda", "no CUDA device is visible"),
    (4, "cuda:1", "--device cuda:1 would put all 2 local ranks"),
])
def test_clients_refuse_before_spawning(cpu_config, gpus, no_spawn, visible, device, match):
    gpus(visible)
    config = dataclasses.replace(cpu_config, device=device)
    with pytest.raises(ValueError, match=match):
        dp_client.DPEngineClient(config)
    with pytest.raises(ValueError, match=match):
        AsyncEngineClient(config)
    with pytest.raises(ValueError, match=match):
        run_headless(config)


def test_clients_accept_one_gpu_per_local_rank(cpu_config, gpus, monkeypatch):
    gpus(2)
    spawned = []
    monkeypatch.setattr(dp_client.mp, "get_context", lambda method: spawned.append(method) or (_ for _ in ()).throw(
        RuntimeError("stop after the check")))
    with pytest.raises(RuntimeError, match="stop after the check"):
        dp_client.spawn_local_ranks(dataclasses.replace(cpu_config, device="cuda"))
    assert spawned == ["spawn"]
