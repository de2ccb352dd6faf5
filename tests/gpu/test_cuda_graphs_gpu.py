"""Decode CUDA graphs (engine/worker/cuda_graphs.py) on a GPU: greedy tokens of graphs, eager and
the CPU identical on a float32 checkpoint; the null block zero after capture and after 1000
dummy replays; a capture that dirties it stops start-up naming the layer; decode tokens/s of
graphs vs eager printed. The padding plan itself is tested on CPU (tests/engine/test_cuda_graphs.py)."""
from __future__ import annotations

import time

import pytest
import torch

from engine.config import EngineConfig
from engine.engine_core.engine_core import EngineCore
from engine.messages import EngineRequest
from engine.paging import NULL_BLOCK_ID
from engine.sampling_params import SamplingParams
from engine.worker.cuda_graphs import DecodeGraphs, NullBlockDirtied
from engine.worker.kv_cache import layer_tensors

pytestmark = pytest.mark.gpu

PROMPTS = [list(range(5, 17)), [7, 8, 9], list(range(20, 61)), [3], list(range(100, 119))]
ENGINE_ARGS = dict(max_model_len=256, kv_cache_memory="64MiB", max_num_seqs=32)


@pytest.fixture
def strict_fp32(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def make_core(path: str, device: str, **kwargs) -> EngineCore:
    return EngineCore(EngineConfig.create(path, device=device, **{"dtype": "float32", **{**ENGINE_ARGS, **kwargs}}))


def greedy(core: EngineCore, limits: list[int]) -> list[list[int]]:
    for i, (prompt, limit) in enumerate(zip(PROMPTS, limits)):
        core.add_request(EngineRequest(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=limit,
                                                                       ignore_eos=True)))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while core.has_unfinished:
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    return list(tokens.values())


# MoE (Mixtral, Qwen2-MoE with its shared expert) and MLA + MoE (DeepSeek-V3) capture their
# fixed-shape paths.
MOE_PRESETS = ["tiny-mixtral", "tiny-qwen2-moe", "tiny-deepseek-v3"]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", *MOE_PRESETS])
def test_graphs_eager_and_cpu_give_identical_greedy_tokens(cuda_kernels, checkpoint, strict_fp32, preset):
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


@pytest.mark.parametrize("preset, num_replays", [("tiny-llama", 1000), ("tiny-deepseek-v3", 200)])
def test_null_block_zero_after_capture_and_dummy_replays(cuda_kernels, checkpoint, preset, num_replays):
    core = make_core(checkpoint(preset), "cuda", cuda_graph_check_null_block=True,
                     dummy_batch_random_inputs=True)
    graphs = core.runner.graphs
    assert graphs.null_block_dirty_layers() == []  # after capture (start-up checked it too)
    greedy(core, [4] * len(PROMPTS))
    before = core.runner.kv_storage.clone()
    replays = graphs.replays
    sizes = (1, 3, 8, 13, 32, 5, 24, 2)
    for i in range(num_replays):
        core.run_dummy(sizes[i % len(sizes)])  # raises NullBlockDirtied at the first dirty replay
    torch.cuda.synchronize()
    assert graphs.replays - replays == num_replays
    assert graphs.null_block_dirty_layers() == []
    assert torch.equal(before.view(torch.uint8), core.runner.kv_storage.view(torch.uint8))
    assert int(core.runner.null_block_writes.item()) == 0


def test_a_capture_that_dirties_the_null_block_fails_start_up_naming_the_layer(cuda_kernels, checkpoint,
                                                                                monkeypatch):
    """Layer 1 writes into block 0 while it is captured (from test code: a forward hook installed
    just before capture); ModelRunner's start-up must stop and name layer 1 only."""
    capture = DecodeGraphs.capture

    def capture_with_a_dirty_layer(self):
        k_cache = layer_tensors(self.kv_caches[1])[0]

        def dirty(module, args, output):
            k_cache[NULL_BLOCK_ID, 0, 0, 0] = 1.0

        self.model.model.layers[1].register_forward_hook(dirty)
        capture(self)

    monkeypatch.setattr(DecodeGraphs, "capture", capture_with_a_dirty_layer)
    with pytest.raises(NullBlockDirtied, match=r"after CUDA graph capture: layer\(s\) 1 were written"):
        make_core(checkpoint("tiny-llama"), "cuda")


def decode_rate(core: EngineCore, batch: int, steps: int = 32) -> float:
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        core.add_request(EngineRequest(f"b{batch}-{i}", list(range(5 + i, 13 + i)), params))
    core.step()  # prefill
    core.step()  # a first decode step, untimed
    torch.cuda.synchronize()
    start, count = time.perf_counter(), 0
    while core.has_unfinished:
        core.step()
        count += 1
    torch.cuda.synchronize()
    return batch * count / (time.perf_counter() - start)


def test_decode_tokens_per_second_graphs_vs_eager(cuda_kernels, checkpoint):
    """Printed for the README (pytest -rA shows it); only asserted to have run."""
    path = checkpoint("tiny-llama")
    graphs, eager = make_core(path, "cuda"), make_core(path, "cuda", enforce_eager=True)
    for batch in (1, 8, 32):
        fast, slow = decode_rate(graphs, batch), decode_rate(eager, batch)
        print(f"decode tokens/s at batch {batch:>2}, tiny-llama float32: graphs {fast:9.1f}, eager {slow:9.1f} "
              f"({fast / slow:.2f}x)")
        assert fast > 0 and slow > 0
