"""Decode CUDA graphs for MoE and MLA models (engine/worker/cuda_graphs.py) on a GPU: the
fixed-shape forward of a tiny Mixtral, a tiny Qwen2-MoE (MoE) and a tiny DeepSeek-V3 (MLA + MoE) makes no host
sync (CUDA's sync debug mode set to error). Their tokens through graphs vs eager vs CPU and the
null block after dummy replays are in tests/gpu/test_cuda_graphs_gpu.py (MOE_PRESETS).
The same fixed-shape forwards are tested eagerly on CPU by tests/engine/test_cuda_graphs_moe.py.
Expert parallelism over NCCL under graphs (DP > 1) needs two GPUs and is not tested here."""
from __future__ import annotations

import pytest
import torch

from tests.gpu.test_cuda_graphs_gpu import MOE_PRESETS, make_core

pytestmark = pytest.mark.gpu


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

