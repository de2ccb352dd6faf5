"""Decode CUDA graphs for MoE and MLA models (engine/worker/cuda_graphs.py) on a GPU: a tiny
Mixtral (MoE) and a tiny DeepSeek-V3 (MLA + MoE) give identical greedy tokens through graphs,
eagerly and on the CPU in float32; the null block is zero after capture and after dummy
replays; the fixed-shape forward makes no host sync (CUDA's sync debug mode set to error).
The same fixed-shape forwards are tested eagerly on CPU by tests/engine/test_cuda_graphs_moe.py.
Expert parallelism over NCCL under graphs (DP > 1) needs two GPUs and is not tested here."""
from __future__ import annotations

import pytest
import torch

from tests.gpu.test_cuda_graphs_gpu import greedy, make_core, strict_fp32  # noqa: F401 (a fixture)

pytestmark = pytest.mark.gpu

MOE_PRESETS = ["tiny-mixtral", "tiny-deepseek-v3"]


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_moe_graphs_eager_and_cpu_give_identical_greedy_tokens(cuda_kernels, checkpoint, strict_fp32, preset):
    path = checkpoint(preset)
    limits = [16, 5, 12, 9, 16]  # requests finish at different steps: batches shrink under the graphs
    graphs = make_core(path, "cuda")
    assert graphs.runner.graphs is not None and graphs.runner.graphs.graphs, "no decode graph was captured"
    assert graphs.runner.graphs.null_block_dirty_layers() == []  # after capture (start-up checked it too)
    graph_tokens = greedy(graphs, limits)
    assert graphs.runner.graphs.replays >= 10
    eager = make_core(path, "cuda", enforce_eager=True)
    assert eager.runner.graphs is None
    assert graph_tokens == greedy(eager, limits) == greedy(make_core(path, "cpu"), limits)
    assert int(graphs.runner.null_block_writes.item()) == 0
    assert graphs.runner.graphs.null_block_dirty_layers() == []


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_moe_fixed_shape_forward_makes_no_host_sync(cuda_kernels, checkpoint, preset):
    """What capture needs, checked where it fails readably: any synchronising op (.item(),
    nonzero, a boolean mask, a copy to the host) in the fixed-shape forward raises here."""
    core = make_core(checkpoint(preset), "cuda")
    graphs = core.runner.graphs
    graphs.buffers.fill_padding()
    core.runner.write_guard.begin_step([])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            for size in graphs.sizes:
                graphs.forward(size)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert graphs.null_block_dirty_layers() == []


def test_deepseek_null_block_zero_after_dummy_replays(cuda_kernels, checkpoint):
    core = make_core(checkpoint("tiny-deepseek-v3"), "cuda", cuda_graph_check_null_block=True,
                     dummy_batch_random_inputs=True)
    graphs = core.runner.graphs
    greedy(core, [4] * 5)
    before = core.runner.kv_storage.clone()
    replays = graphs.replays
    sizes = (1, 3, 8, 13, 32, 5, 24, 2)
    for i in range(200):
        core.run_dummy(sizes[i % len(sizes)])  # raises NullBlockDirtied at the first dirty replay
    torch.cuda.synchronize()
    assert graphs.replays - replays == 200
    assert graphs.null_block_dirty_layers() == []
    assert torch.equal(before.view(torch.uint8), core.runner.kv_storage.view(torch.uint8))
    assert int(core.runner.null_block_writes.item()) == 0
