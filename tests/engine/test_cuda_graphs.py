"""The decode-graph path (engine/worker/cuda_graphs.py) on CPU: the padding plan, the persistent
buffers, and the fixed-shape forward that a GPU captures and replays, run eagerly over the same
buffers. On a GPU the graphs themselves are tested by tests/gpu/test_cuda_graphs_gpu.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import MAX_CUDA_GRAPH_SIZE, EngineConfig, default_cuda_graph_sizes
from engine.engine_core.engine_core import EngineCore
from engine.engine_args import parse_sizes
from engine.messages import EngineRequest, Fault
from engine.ops import flex_attention
from engine.ops.attention import AttentionMetadata
from engine.paging import NULL_BLOCK_ID, PAD_SLOT_ID
from engine.sampling_params import SamplingParams
from engine.worker.batch_builder import StepBatch
from engine.worker.cuda_graphs import DecodeBuffers, DecodeGraphs, NullBlockDirtied, eager_reason, graph_size
from engine.worker.faults import inject
from engine.worker.kv_cache import layer_tensors

pytestmark = pytest.mark.skipif(not flex_attention.available(), reason="torch has no FlexAttention")

SIZES = (1, 2, 4, 8, 16, 24, 32)
MAX_BLOCKS = 6


def decode_batch(num_reqs: int, num_padded: int, base: int) -> StepBatch:
    """`num_reqs` one-token requests padded to `num_padded` tokens, as the batch builder makes
    them; every real value is distinct and non-zero (derived from `base`)."""
    ids = torch.zeros(num_padded, dtype=torch.int64)
    positions = torch.zeros(num_padded, dtype=torch.int64)
    slots = torch.full((num_padded,), PAD_SLOT_ID, dtype=torch.int64)
    ids[:num_reqs] = torch.arange(num_reqs) + base
    positions[:num_reqs] = torch.arange(num_reqs) + 3
    slots[:num_reqs] = torch.arange(num_reqs) + 16 * base
    tables = (torch.arange(max(num_reqs, 1) * MAX_BLOCKS, dtype=torch.int32).view(-1, MAX_BLOCKS) + base)
    starts = list(range(num_reqs + 1))
    lens = list(range(4, 4 + num_reqs))
    meta = AttentionMetadata(num_reqs=num_reqs, num_tokens=num_reqs, num_padded_tokens=num_padded,
                             slot_mapping=slots, query_start_loc=torch.tensor(starts),
                             seq_lens=torch.tensor(lens, dtype=torch.int64), block_tables=tables,
                             query_start_loc_cpu=starts, seq_lens_cpu=lens, max_seq_len=max(lens, default=0))
    return StepBatch(input_ids=ids, positions=positions, meta=meta, logits_indices=list(range(num_reqs)))


def assert_padding_from(buffers: DecodeBuffers, first_token: int, first_req: int) -> None:
    assert buffers.slot_mapping[first_token:].eq(PAD_SLOT_ID).all()
    assert buffers.input_ids[first_token:].eq(0).all() and buffers.positions[first_token:].eq(0).all()
    assert buffers.block_tables[first_req:].eq(NULL_BLOCK_ID).all()
    assert buffers.seq_lens[first_req:].eq(0).all()


# -- the padding plan ----------------------------------------------------------------------------

def test_a_step_pads_to_the_next_captured_size():
    assert [graph_size(SIZES, n) for n in (1, 2, 3, 5, 13, 16, 17, 25, 32)] == [1, 2, 4, 8, 16, 16, 24, 32, 32]
    assert graph_size(SIZES, 33) is None  # larger than every graph: eager


def test_default_sizes_are_vllm_like_and_cover_max_num_seqs():
    assert default_cuda_graph_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_cuda_graph_sizes(13) == (1, 2, 4, 8, 16)
    assert default_cuda_graph_sizes(1) == (1,)
    large = default_cuda_graph_sizes(10_000)
    assert large[-1] == MAX_CUDA_GRAPH_SIZE and 248 in large and 256 in large and 272 in large and 264 not in large
    assert parse_sizes("8, 1,4") == (8, 1, 4) and parse_sizes("1 2") == (1, 2)


def test_config_sorts_given_sizes_and_defaults_from_max_num_seqs(checkpoint):
    path = checkpoint("tiny-llama")
    assert EngineConfig.create(path, max_num_seqs=20, dtype="float32").cuda_graph_sizes == (1, 2, 4, 8, 16, 24)
    assert EngineConfig.create(path, cuda_graph_sizes=(8, 1, 8, 4), dtype="float32").cuda_graph_sizes == (1, 4, 8)
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineConfig.create(path, cuda_graph_sizes=(0, 4), dtype="float32")


def test_graphs_apply_only_on_cuda_without_enforce_eager(checkpoint):
    dense = EngineConfig.create(checkpoint("tiny-llama"), dtype="float32")
    assert eager_reason(dense) == "not a CUDA device"
    assert eager_reason(dataclasses.replace(dense, device="cuda", enforce_eager=True)) == "--enforce-eager"
    # MoE and MLA models capture too (tests/engine/test_cuda_graphs_moe.py): only the machine decides.
    on_cuda = eager_reason(dataclasses.replace(dense, device="cuda"))
    for preset in ("tiny-mixtral", "tiny-deepseek-v3"):
        model = EngineConfig.create(checkpoint(preset), dtype="float32")
        assert eager_reason(dataclasses.replace(model, device="cuda")) == on_cuda


# -- the persistent buffers ------------------------------------------------------------------------

def test_every_padded_row_is_pad_slot_null_table_length_zero():
    buffers = DecodeBuffers(SIZES[-1], MAX_BLOCKS, "cpu")
    batch = decode_batch(5, 6, base=7)  # the builder padded 5 to 6; the graph pads on to 8
    buffers.fill(batch)
    assert torch.equal(buffers.slot_mapping[:6], batch.meta.slot_mapping)
    assert torch.equal(buffers.block_tables[:5], batch.meta.block_tables[:5])
    assert torch.equal(buffers.seq_lens[:5], batch.meta.seq_lens)
    assert torch.equal(buffers.input_ids[:5], batch.input_ids[:5])
    assert_padding_from(buffers, 5, 5)
    meta = buffers.metadata(graph_size(SIZES, 6))
    assert meta.fixed_shape and meta.slot_mapping.shape == (8,) and meta.block_tables.shape == (8, MAX_BLOCKS)
    assert meta.query_start_loc.tolist() == list(range(9))


def test_a_smaller_step_after_a_larger_one_keeps_nothing_stale():
    buffers = DecodeBuffers(SIZES[-1], MAX_BLOCKS, "cpu")
    buffers.fill(decode_batch(32, 32, base=100))
    assert buffers.slot_mapping.ge(0).all()  # the large step filled every row
    small = decode_batch(13, 13, base=1)
    buffers.fill(small)
    assert graph_size(SIZES, 13) == 16
    assert torch.equal(buffers.slot_mapping[:13], small.meta.slot_mapping)
    assert_padding_from(buffers, 13, 13)  # rows 13..15 that the graph reads, and every row after them
    buffers.fill(decode_batch(0, 3, base=5))  # a dummy batch: padding everywhere
    assert_padding_from(buffers, 0, 0)


# -- the fixed-shape forward in the engine ---------------------------------------------------------

PROMPTS = [list(range(5, 17)), [7, 8, 9], list(range(20, 61)), [3], list(range(100, 119))]


def make_core(path: str, graphs: bool, **kwargs) -> EngineCore:
    config = EngineConfig.create(path, max_model_len=128, block_size=4, num_gpu_blocks=96,
                                 cuda_graph_sizes=(1, 2, 4, 8), **{"dtype": "float32", **kwargs})
    core = EngineCore(config)
    if graphs:  # what ModelRunner does on a GPU; on CPU no graph is captured, the forwards run eagerly
        runner = core.runner
        runner.graphs = DecodeGraphs(config, runner.model, runner.kv_storage, runner.kv_caches,
                                     runner.null_block_writes, runner.write_guard)
        with torch.inference_mode():
            runner.graphs.capture()
    return core


def generate(core: EngineCore, max_tokens: list[int]) -> dict[str, tuple[list[int], list[float]]]:
    for i, (prompt, limit) in enumerate(zip(PROMPTS, max_tokens)):
        params = SamplingParams(temperature=0.0, max_tokens=limit, ignore_eos=True, logprobs=0)
        core.add_request(EngineRequest(f"r{i}", prompt, params))
    result = {f"r{i}": ([], []) for i in range(len(PROMPTS))}
    while core.has_unfinished:
        for out in core.step():
            result[out.request_id][0].extend(out.new_token_ids)
            result[out.request_id][1].extend(lp.logprob for lp in out.new_logprobs or [])
    return result


def cache_bytes(core: EngineCore) -> torch.Tensor:
    return core.runner.kv_storage.view(torch.uint8).clone()


# The MoE and MLA presets run their fixed-shape path (dense experts, MLA through FlexAttention).
MOE_PRESETS = ["tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-deepseek-v2", "tiny-deepseek-v3"]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", *MOE_PRESETS])
def test_greedy_tokens_through_the_padded_buffers_equal_eager(checkpoint, preset):
    """Requests finishing at different steps: decode batches of 5, 4, 2, 1 rows padded to 8, 4, 2, 1,
    each after a larger one."""
    path = checkpoint(preset)
    limits = [10, 3, 7, 5, 9]
    eager = generate(make_core(path, graphs=False), limits)
    core = make_core(path, graphs=True)
    padded = generate(core, limits)
    assert core.runner.graphs.replays >= 9  # every decode step went through the buffers
    for key in eager:
        assert padded[key][0] == eager[key][0], key
        assert max(abs(a - b) for a, b in zip(padded[key][1], eager[key][1])) < 1e-4, key
    assert int(core.runner.null_block_writes.item()) == 0
    assert core.runner.graphs.null_block_dirty_layers() == []


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mixtral", "tiny-deepseek-v3"])
def test_dummy_batches_through_the_buffers_leave_the_cache_unchanged(checkpoint, preset):
    core = make_core(checkpoint(preset), graphs=True, cuda_graph_check_null_block=True,
                     dummy_batch_random_inputs=True)
    generate(core, [4, 2, 3, 1, 2])  # real K/V (or MLA latents) in the cache, stale rows in the buffers
    before = cache_bytes(core)
    replays = core.runner.graphs.replays
    for num_padded in (1, 3, 8, 5, 2):
        core.run_dummy(num_padded)
    assert core.runner.graphs.replays == replays + 5
    assert torch.equal(cache_bytes(core), before)
    assert int(core.runner.null_block_writes.item()) == 0
    assert core.runner.graphs.buffers.slot_mapping.eq(PAD_SLOT_ID).all()


def test_a_capture_that_dirties_the_null_block_fails_naming_the_layer(checkpoint):
    config = EngineConfig.create(checkpoint("tiny-llama"), max_model_len=64, num_gpu_blocks=32,
                                 cuda_graph_sizes=(1, 4), dtype="float32")
    core = EngineCore(config)
    runner = core.runner
    k_cache = layer_tensors(runner.kv_caches[1])[0]

    def dirty(module, args, output):  # a layer that writes into block 0 while being captured
        k_cache[NULL_BLOCK_ID, 0, 0, 0] = 1.0

    runner.model.model.layers[1].register_forward_hook(dirty)
    graphs = DecodeGraphs(config, runner.model, runner.kv_storage, runner.kv_caches,
                          runner.null_block_writes, runner.write_guard)
    with pytest.raises(NullBlockDirtied, match=r"after CUDA graph capture: layer\(s\) 1 were written"):
        with torch.inference_mode():
            graphs.capture()


def test_the_debug_check_stops_a_legacy_dummy_batch(checkpoint):
    """The fault injector's broken dummy batch (every slot 0, in the null block, NaN activations
    from a forward hook) runs eagerly -- a hook could not run inside a replayed graph -- and the
    debug check after it names the bug."""
    core = make_core(checkpoint("tiny-llama"), graphs=True, cuda_graph_check_null_block=True)
    core.run_dummy(4)  # clean, through the buffers
    replays = core.runner.graphs.replays
    inject(core.runner, Fault(kind="legacy_dummy"))
    with pytest.raises(NullBlockDirtied, match="after a dummy batch: layer"):
        core.run_dummy(4)
    assert core.runner.graphs.replays == replays


def test_a_stale_slot_dummy_goes_through_the_buffers_as_built_and_is_counted(checkpoint):
    """The buffers copy the batch the builder (here: the fault injector) made, so a stale slot
    mapping is not hidden by the graph path: its writes are counted as foreign."""
    core = make_core(checkpoint("tiny-llama"), graphs=True)
    generate(core, [3, 2, 3, 1, 2])
    replays = core.runner.graphs.replays
    core.inject_fault(Fault(kind="stale_slot_dummy"))  # replays the broken dummy batch at once
    assert core.runner.graphs.replays == replays + 1
    assert int(core.runner.write_guard.foreign_writes.item()) > 0
