"""Decode graphs for MoE and MLA models on CPU: the fixed-shape forward a GPU captures
(StackedExperts.forward_fixed, MLA decode through FlexAttention, expert-parallel collectives of
the graph size), run eagerly over the persistent buffers. On a GPU the captured graphs
themselves are tested by tests/gpu/test_cuda_graphs_moe_gpu.py."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine import LLM
from engine.config import EngineConfig
from engine.engine_core.engine_core import EngineCore
from engine.dp import client as dp_client
from engine.ops import cuda_ops, flex_attention
from engine.ops.attention import AttentionMetadata
from engine.models.moe import SparseMoeBlock
from engine.ops.checksum import block_words
from engine.paging import NULL_BLOCK_ID
from engine.sampling_params import SamplingParams
from engine.worker.cuda_graphs import eager_reason
from engine.worker.kv_cache import block_axis
from engine.worker.loader import load_model
from tests.engine.dp_helpers import Collected, drain, free_port_block, make_prompts, request
from tests.engine.test_cuda_graphs import MOE_PRESETS, generate, make_core

pytestmark = pytest.mark.skipif(not flex_attention.available(), reason="torch has no FlexAttention")

def test_moe_and_mla_models_choose_decode_graphs_at_dp1_and_with_expert_parallelism(checkpoint, monkeypatch):
    """The choice only: on a CUDA device with the KV writers built, dense, MoE and MLA models
    all take the decode-graph path, alone and as a rank of an expert-parallel group; only
    --enforce-eager turns it off. Nothing is captured here (no GPU): capture and replay of these
    models -- graphs made for every size, replayed, tokens equal to eager and CPU -- are tested
    by tests/gpu/test_cuda_graphs_gpu.py (MOE_PRESETS); the fixed-shape forwards a capture
    records run eagerly on CPU in the tests below."""
    monkeypatch.setattr(cuda_ops, "available", lambda: True)  # as on a GPU machine with the ops built
    for preset in ("tiny-llama", "tiny-mixtral", "tiny-qwen2-moe", "tiny-deepseek-v3"):
        config = dataclasses.replace(EngineConfig.create(checkpoint(preset), dtype="float32"), device="cuda")
        assert eager_reason(config) is None, preset
        dp2 = EngineConfig.create(checkpoint(preset), data_parallel_size=2, data_parallel_rank=1, dtype="float32")
        assert eager_reason(dataclasses.replace(dp2, device="cuda")) is None, preset
        assert eager_reason(dataclasses.replace(config, enforce_eager=True)) == "--enforce-eager"


class NoHostRead(TorchFunctionMode):
    """Fails on the torch calls that read a device value back to the host (or make a shape that
    depends on one): what a CUDA graph cannot capture."""
    HOST_READS = {"item", "tolist", "nonzero", "argwhere", "bincount", "unique", "unique_consecutive",
                  "masked_select", "repeat_interleave", "__bool__", "__int__", "__float__", "__index__"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.HOST_READS:
            raise AssertionError(f"host read in a fixed-shape step: {name}")
        if name in ("__getitem__", "__setitem__") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool
                for i in (args[1] if isinstance(args[1], tuple) else (args[1],))):
            raise AssertionError("boolean-mask indexing in a fixed-shape step")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_fixed_shape_moe_blocks_read_nothing_back_and_equal_the_eager_blocks(checkpoint, preset):
    """Every MoE block (router, experts, shared experts) of the fixed-shape step runs without a host
    read; the eager block, which does read back (nonzero, expert counts), is caught by the same check."""
    model = load_model(EngineConfig.create(checkpoint(preset), dtype="float32"))
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    hidden = torch.randn(8, model.config.model.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for block in blocks:
            with block.ep.step(8, fixed_shape=True), NoHostRead():
                fixed = block(hidden)
            eager = block(hidden)
            assert torch.allclose(fixed, eager, atol=1e-5, rtol=1e-5)
        with pytest.raises(AssertionError, match="host read"), NoHostRead():
            blocks[0](hidden)


# -- DP = 1: padded rows (tokens and dummy batches: tests/engine/test_cuda_graphs.py, MOE_PRESETS) ---

@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen2-moe", "tiny-deepseek-v3"])
def test_padded_rows_write_nothing_and_change_no_real_row(checkpoint, preset):
    """Three real decode rows padded to 8: whatever the padded rows hold (token, position), the real
    rows' hidden states are bitwise the same and the cache is written only at the real rows' slots --
    the routing of padded rows reaches no real row (dense experts, rows independent)."""
    core = make_core(checkpoint(preset), graphs=True)
    generate(core, [3, 2, 3, 1, 2])  # real contents in the blocks the rows below read
    graphs, block_size = core.runner.graphs, core.config.block_size
    buffers = graphs.buffers
    lengths = torch.tensor([5, 9, 14])
    tables = torch.tensor([[1, 2, 0, 0], [3, 4, 5, 0], [6, 7, 8, 9]], dtype=torch.int32)
    positions = lengths - 1
    slots = tables[torch.arange(3), positions // block_size].long() * block_size + positions % block_size

    def run(pad_ids: torch.Tensor, pad_positions: torch.Tensor) -> torch.Tensor:
        buffers.fill_padding()
        buffers.input_ids[:3] = torch.tensor([11, 22, 33])
        buffers.positions[:3] = positions
        buffers.seq_lens[:3] = lengths
        buffers.block_tables[:3, :4] = tables
        buffers.slot_mapping[:3] = slots
        buffers.input_ids[3:8] = pad_ids
        buffers.positions[3:8] = pad_positions
        core.runner.write_guard.begin_step(tables.unique().tolist())
        with torch.inference_mode():
            return graphs.forward(8)[:3].clone()

    storage = core.runner.kv_storage
    before = storage.clone()
    quiet = run(torch.zeros(5, dtype=torch.int64), torch.zeros(5, dtype=torch.int64))
    after_quiet = storage.clone()
    gen = torch.Generator().manual_seed(5)
    vocab = core.config.model.vocab_size
    noisy = run(torch.randint(1, vocab, (5,), generator=gen), torch.randint(0, 100, (5,), generator=gen))
    assert torch.equal(quiet, noisy)
    assert torch.equal(storage.view(torch.uint8), after_quiet.view(torch.uint8))  # same values rewritten
    # The blocks written are exactly the real rows' last blocks: padded rows wrote nowhere.
    axis = block_axis(core.config)
    changed = (block_words(before, axis) != block_words(after_quiet, axis)).flatten(1).any(dim=1)
    assert changed.nonzero().flatten().tolist() == sorted((slots // block_size).tolist())
    assert graphs.null_block_dirty_layers() == []
    assert int(core.runner.null_block_writes.item()) == 0
    assert int(core.runner.write_guard.foreign_writes.item()) == 0


# -- MLA decode: the fixed-shape read against the existing one, NaN in the null block -----------

@pytest.mark.parametrize("preset", ["tiny-deepseek-v2", "tiny-deepseek-v3"])
def test_fixed_shape_mla_decode_equals_the_eager_read_and_spreads_a_null_block_nan_the_same_way(
        checkpoint, preset):
    config = EngineConfig.create(checkpoint(preset), max_model_len=64, block_size=4, num_gpu_blocks=32, dtype="float32")
    attn = load_model(config).model.layers[0].self_attn
    gen = torch.Generator().manual_seed(3)
    width = attn.kv_lora_rank + attn.rope_dim
    cache = torch.randn(32, 4, width, generator=gen)
    cache[NULL_BLOCK_ID] = 0
    lengths = [3, 9, 16, 6]  # the longest row fills the whole table (4 blocks): both read 4 entries
    tables = torch.tensor([[1, 0, 0, 0], [2, 3, 4, 0], [5, 6, 7, 8], [9, 10, 0, 0]], dtype=torch.int32)
    q_nope = torch.randn(4, attn.num_heads, attn.nope_dim, generator=gen)
    q_pe = torch.randn(4, attn.num_heads, attn.rope_dim, generator=gen)
    eager_meta = AttentionMetadata(num_reqs=4, num_tokens=4, num_padded_tokens=4, slot_mapping=torch.full((4,), -1),
                                   query_start_loc=torch.arange(5), seq_lens=torch.tensor(lengths),
                                   block_tables=tables, query_start_loc_cpu=list(range(5)), seq_lens_cpu=lengths,
                                   max_seq_len=16)
    # Fixed shape: the same four rows and four padded ones (length 0, null table row).
    pad_tables = torch.cat([tables, torch.zeros(4, 4, dtype=torch.int32)])
    fixed_meta = AttentionMetadata.fixed_decode(torch.full((8,), -1), torch.arange(9),
                                                torch.tensor(lengths + [0] * 4), pad_tables)
    pad = lambda x: torch.cat([x, torch.randn(4, *x.shape[1:], generator=gen)])  # noqa: E731
    with torch.inference_mode():
        eager = attn._decode(q_nope, q_pe, cache, eager_meta)
        fixed = attn._decode(pad(q_nope), pad(q_pe), cache, fixed_meta)
        assert torch.allclose(fixed[:4], eager, atol=1e-5, rtol=1e-5)
        assert fixed[4:].eq(0).all()  # padded rows: every position masked
        cache[NULL_BLOCK_ID] = float("nan")
        eager = attn._decode(q_nope, q_pe, cache, eager_meta)
        fixed = attn._decode(pad(q_nope), pad(q_pe), cache, fixed_meta)
    shorter = torch.tensor([True, True, False, True])  # rows whose table row holds the null block
    assert torch.equal(torch.isnan(eager).flatten(1).all(dim=1), shorter)
    assert torch.equal(torch.isnan(fixed[:4]).flatten(1).all(dim=1), shorter)
    assert torch.isfinite(fixed[2]).all() and torch.allclose(fixed[2], eager[2], atol=1e-5, rtol=1e-5)


# -- DP = 2 with expert parallelism on gloo: the lockstep group agrees on the path --------------

def graph_rank(report_dir: str, config: EngineConfig, rank: int, generation: int | None = 0) -> None:
    """A rank process's entry point: the real `run_rank` with decode graphs on CPU (eager_reason
    answering None, so the runner builds DecodeGraphs and runs its fixed-shape forwards eagerly),
    reporting its replays and the null block after every stats report."""
    from engine.dp import rank as rank_module
    from engine.worker import model_runner

    model_runner.eager_reason = lambda config: None  # this spawned process only

    class GraphCore(EngineCore):
        def stats(self):
            stats = super().stats()
            graphs = self.runner.graphs
            report = {"steps": stats.steps, "dummy_batches": stats.dummy_batches, "replays": graphs.replays,
                      "dirty": graphs.null_block_dirty_layers()}
            path = Path(report_dir) / f"port{config.parallel.data_parallel_rpc_port}-rank{rank}.json"
            path.with_suffix(".tmp").write_text(json.dumps(report))
            os.replace(path.with_suffix(".tmp"), path)
            return stats

    rank_module.EngineCore = GraphCore
    rank_module.run_rank(config, rank, generation)


DP_ARGS = dict(max_model_len=128, num_gpu_blocks=64, cuda_graph_sizes=(1, 2, 4, 8))
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def staggered(engine, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Rank 0 decodes request 0 alone; once it has 3 tokens rank 1 gets the others one at a time,
    each a short prefill: steps of at most 8 tokens where one rank decodes (a graph size) while the
    other prefills. Both must run such a step eagerly, or their expert collectives would not match."""
    collected = Collected()
    engine.add_request(request("s0", prompts[0], GREEDY), rank=0)
    deadline = time.monotonic() + 60
    while len(collected.tokens.get("s0", [])) < 3:
        assert time.monotonic() < deadline, "rank 0 never started decoding"
        collected.feed(engine.step(timeout=0.2))
    for i, prompt in enumerate(prompts[1:], start=1):
        engine.add_request(request(f"s{i}", prompt, GREEDY), rank=1)
        collected.feed(engine.step(timeout=0.2))
    drain(engine, collected, [f"s{i}" for i in range(len(prompts))])
    return {rid: tokens for rid, tokens in collected.tokens.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-mixtral"])
def test_dp2_expert_parallel_fixed_shape_tokens_equal_dp1_eager(checkpoint, tmp_path, preset):
    """Two gloo ranks whose pure-decode steps and dummy batches run the fixed-shape forward with
    fixed-shape EP collectives, and whose other steps run eagerly -- decided together each step --
    give the DP=1 eager tokens: requests spread over both ranks, all on rank 0 (rank 1 runs dummy
    batches through the buffers), and staggered so that one rank prefills while the other decodes."""
    path = checkpoint(preset)
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(vocab, (1, 13, 5, 22, 3, 9), seed=4)
    short = make_prompts(vocab, (5, 3, 6, 2), seed=5)
    single = LLM(path, **{"dtype": "float32", **DP_ARGS})
    try:
        expected = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY)]
        expected_short = [o.outputs[0].token_ids for o in single.generate(short, GREEDY)]
    finally:
        single.close()
    with mock.patch.object(dp_client, "run_rank", functools.partial(graph_rank, str(tmp_path))):
        llm = LLM(path, data_parallel_size=2, data_parallel_rpc_port=free_port_block(3), **{"dtype": "float32", **DP_ARGS})
    try:
        spread = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, rank_of=[0, 1] * 3)]
        on_rank0 = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, rank_of=[0] * 6)]
        mixed = staggered(llm.engine, short)
        port = llm.engine.config.parallel.data_parallel_rpc_port
        stats = llm.engine.stats
    finally:
        llm.close()
    assert spread == expected
    assert on_rank0 == expected
    assert [mixed[f"s{i}"] for i in range(len(short))] == expected_short
    reports = [json.loads((tmp_path / f"port{port}-rank{r}.json").read_text()) for r in (0, 1)]
    for rank, report in enumerate(reports):
        assert report["replays"] >= 8, (rank, report)  # decode steps (and rank 1's dummies) went through the buffers
        assert report["dirty"] == [], rank
    assert reports[1]["dummy_batches"] > 0
    assert all(s.integrity.null_block_writes == 0 for s in stats.values())
