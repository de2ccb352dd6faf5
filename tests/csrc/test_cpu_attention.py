"""csrc/cpu/cpu_attention.cpp (the paged_decode_attention op) against its torch
reference (engine.ops.attention.decode_attention_reference): values, NaN propagation from the
null block, layouts, dtypes and the op's checks. Needs the ops built (`kvsentry_ops`)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engine.ops import cpu_ops
from engine.ops.attention import (PAD_SLACK_BLOCKS, AttentionMetadata, DecodePlan, decode_attention_reference,
                                  plan_decode_reads)
from engine.ops.attention_backends import AttentionBackend, paged_attention
from engine.ops.library import cpu_capability as cpu_ops_capability

TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def make_case(*, batch=6, num_heads=8, num_kv_heads=4, head_dim=32, v_dim=None, block_size=16,
              num_blocks=64, dtype=torch.float32, layout="head_major", seed=0, max_len=150, lens=None):
    """Caches with random contents, distinct blocks per request, tables padded with 0."""
    g = torch.Generator().manual_seed(seed)
    v_dim = v_dim or head_dim
    if layout == "head_major":  # the engine's CPU layout: physical [Hkv, NB, bs, D]
        k_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=g).permute(1, 2, 0, 3)
        v_cache = torch.randn(num_kv_heads, num_blocks, block_size, v_dim, generator=g).permute(1, 2, 0, 3)
    else:                       # block-major [NB, bs, Hkv, D], the CUDA layout
        k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
        v_cache = torch.randn(num_blocks, block_size, num_kv_heads, v_dim, generator=g)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    seq_lens = torch.randint(1, max_len + 1, (batch,), generator=g) if lens is None else torch.tensor(lens)
    seq_lens[0] = max_len  # the longest request sets how many entries everyone reads
    num_read = -(-max_len // block_size)
    tables = torch.zeros(batch, num_read + 2, dtype=torch.int32)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    for b in range(batch):
        need = -(-int(seq_lens[b]) // block_size)
        tables[b, :need] = torch.tensor([free.pop() for _ in range(need)], dtype=torch.int32)
    query = torch.randn(batch, num_heads, head_dim, generator=g).to(dtype)
    return query, k_cache, v_cache, tables, seq_lens, num_read


def uniform_plan(batch: int, num_read: int) -> DecodePlan:
    """Every row reads num_read entries: one group (the kernel's read_blocks=None)."""
    return DecodePlan(reads=torch.full((batch,), num_read, dtype=torch.int32), num_read=num_read,
                      groups=[(list(range(batch)), num_read)])


def run_kernel(ops, query, k_cache, v_cache, tables, seq_lens, num_read, scale=0.17, plan=None):
    out = torch.full((query.shape[0], query.shape[1], v_cache.shape[-1]), 7.0, dtype=query.dtype)
    reads = None if plan is None else plan.reads
    ops.paged_decode_attention(out, query, k_cache, v_cache, tables, seq_lens, reads, num_read, scale)
    return out


def run_reference(query, k_cache, v_cache, tables, seq_lens, num_read, scale=0.17, plan=None):
    plan = plan or uniform_plan(query.shape[0], num_read)
    return decode_attention_reference(query, k_cache, v_cache, tables, seq_lens, plan, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("layout", ["head_major", "block_major"])
@pytest.mark.parametrize("heads", [(8, 4), (8, 8), (8, 1), (6, 2)], ids=["gqa2", "mha", "mqa", "gqa3"])
def test_matches_reference(kvsentry_ops, dtype, layout, heads):
    case = make_case(num_heads=heads[0], num_kv_heads=heads[1], dtype=dtype, layout=layout)
    out, ref = run_kernel(kvsentry_ops, *case), run_reference(*case)
    torch.testing.assert_close(out.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("block_size, head_dim, v_dim", [(5, 20, 20), (1, 64, 48), (32, 128, 128), (16, 3, 7)])
def test_odd_shapes(kvsentry_ops, block_size, head_dim, v_dim):
    case = make_case(block_size=block_size, head_dim=head_dim, v_dim=v_dim, num_blocks=400, max_len=60)
    torch.testing.assert_close(run_kernel(kvsentry_ops, *case), run_reference(*case), rtol=2e-6, atol=2e-6)


def test_sliced_query_and_output(kvsentry_ops):
    """The engine passes row slices of bigger tensors (out[:decodes], query[:decodes])."""
    query, k, v, tables, lens, num_read = make_case(batch=4)
    big_q = torch.randn(9, *query.shape[1:])
    big_q[:4] = query
    big_out = torch.zeros(9, query.shape[1], v.shape[-1])
    kvsentry_ops.paged_decode_attention(big_out[:4], big_q[:4], k, v, tables, lens, None, num_read, 0.17)
    torch.testing.assert_close(big_out[:4], run_reference(query, k, v, tables, lens, num_read), rtol=2e-6, atol=2e-6)
    assert torch.equal(big_out[4:], torch.zeros_like(big_out[4:]))


@pytest.mark.parametrize("where", ["value", "key"])
def test_nan_in_null_block_spreads_like_the_reference(kvsentry_ops, where):
    """A shorter request reads the null block entries past its own blocks with weight 0:
    a NaN value there still poisons it (0 x NaN), exactly as in the reference; the
    longest request, which reads none, stays clean. A NaN key is masked to -inf first."""
    query, k, v, tables, lens, num_read = make_case(batch=5, max_len=160, lens=[160, 3, 17, 40, 159])
    (v if where == "value" else k)[0, 2, 1, 0] = float("nan")
    out, ref = run_kernel(kvsentry_ops, query, k, v, tables, lens, num_read), run_reference(
        query, k, v, tables, lens, num_read)
    assert torch.equal(out.isnan(), ref.isnan())
    poisoned = out.isnan().flatten(1).any(dim=1).tolist()
    assert poisoned == ([False, True, True, True, False] if where == "value" else [False] * 5)
    torch.testing.assert_close(out.nan_to_num(0.0), ref.nan_to_num(0.0), rtol=2e-6, atol=2e-6)


def test_nan_in_a_real_position_spreads_to_that_request_only(kvsentry_ops):
    query, k, v, tables, lens, num_read = make_case(batch=3, max_len=40)
    k[int(tables[2, 0]), 0, 0, 0] = float("nan")  # request 2's first key, kv head 0
    out = run_kernel(kvsentry_ops, query, k, v, tables, lens, num_read)
    assert out[2, :2].isnan().all() and not out[2, 2:].isnan().any()  # heads 0-1 share kv head 0
    assert not out[:2].isnan().any()


@pytest.mark.parametrize("rows", ["full_tables", "no_rows"])
def test_empty_batch_and_no_blocks(kvsentry_ops, rows):
    """No request: the op writes nothing, as the reference (an empty result) does, whether it
    is handed the tables of a bigger batch or the plan of no rows (num_read = 0)."""
    query, k, v, tables, lens, num_read = make_case()
    if rows == "no_rows":
        plan = plan_decode_reads([], 16, torch.device("cpu"))
        tables, lens, num_read = tables[:0], lens[:0], plan.num_read
        assert num_read == 0
    # Empty, inside room for the whole case's batch, so a kernel that wrote the tables' rows
    # would show in `storage` instead of writing past it.
    storage = torch.full((query.shape[0] + 2, 8, 32), 7.0)
    out = storage[1:1]
    cache_before = (k.clone(), v.clone())
    kvsentry_ops.paged_decode_attention(out, query[:0], k, v, tables, lens, None, num_read, 0.1)
    reference = run_reference(query[:0], k, v, tables[:0], lens[:0], num_read, scale=0.1)
    assert out.shape == reference.shape == (0, 8, 32)
    assert torch.equal(storage, torch.full_like(storage, 7.0))
    assert torch.equal(k, cache_before[0]) and torch.equal(v, cache_before[1])


BAD = [
    (lambda c: c.update(tables=c["tables"].long()), "block_tables must be int32"),
    (lambda c: c.update(lens=c["lens"].int()), "seq_lens must be a contiguous int64"),
    (lambda c: c.update(query=c["query"].double()), "must have query's dtype"),
    (lambda c: c.update(query=c["query"][:, :5]), "multiple of num_kv_heads"),
    (lambda c: c.update(num_read=c["tables"].shape[1] + 1), "block_tables must be int32"),
    (lambda c: c["tables"].__setitem__((1, 0), 10_000), "block table entries must lie in"),
    (lambda c: c["tables"].__setitem__((1, 0), -1), "block table entries must lie in"),
    (lambda c: c.update(out=c["out"][:, :, :5]), "out must be"),
    (lambda c: c.update(query=c["query"].transpose(1, 2).contiguous().transpose(1, 2)), "contiguous last dimension"),
    (lambda c: c.update(reads=torch.full((6,), 99, dtype=torch.int32)), "read_blocks must lie in"),
    (lambda c: c.update(reads=torch.full((6,), 2, dtype=torch.int64)), "read_blocks must be a contiguous int32"),
    (lambda c: c.update(reads=torch.full((2,), 2, dtype=torch.int32)), "read_blocks must be a contiguous int32"),
    (lambda c: c.update(reads=torch.full((6,), 2, dtype=torch.int32)), "exceeds the .* positions its row reads"),
    (lambda c: c.update(num_read=3), "exceeds the .* positions its row reads"),
]


@pytest.mark.parametrize("mutate, message", BAD, ids=[m for _, m in BAD])
def test_checks(kvsentry_ops, mutate, message):
    query, k, v, tables, lens, num_read = make_case()
    case = dict(query=query, tables=tables, lens=lens, num_read=num_read, reads=None,
                out=torch.empty(query.shape[0], query.shape[1], v.shape[-1]))
    mutate(case)
    with pytest.raises(RuntimeError, match=message):
        kvsentry_ops.paged_decode_attention(case["out"], case["query"], k, v, case["tables"], case["lens"],
                                            case["reads"], case["num_read"], 0.1)


def test_paged_attention_dispatches_to_the_kernel(kvsentry_ops, monkeypatch):
    """The engine's attention uses the kernel on CPU and agrees with its own fallback."""
    query, k, v, tables, lens, num_read = make_case(batch=4, max_len=70)
    starts = list(range(5))
    meta = AttentionMetadata(num_reqs=4, num_tokens=4, num_padded_tokens=8,
                             slot_mapping=torch.full((8,), -1), query_start_loc=torch.tensor(starts),
                             seq_lens=lens, block_tables=tables, query_start_loc_cpu=starts,
                             seq_lens_cpu=lens.tolist(), max_seq_len=int(lens.max()))
    padded_q = torch.cat([query, torch.randn(4, *query.shape[1:])])
    calls = []
    real = cpu_ops.paged_decode_attention
    monkeypatch.setattr(cpu_ops, "paged_decode_attention", lambda *a: (calls.append(1), real(*a)))
    fast = paged_attention(padded_q, k, v, meta, 0.2)  # the backend chosen for CPU tensors: the kernel's
    assert calls == [1]
    slow = paged_attention(padded_q, k, v, meta, 0.2, AttentionBackend())  # the torch reference
    assert len(calls) == 1
    torch.testing.assert_close(fast, slow, rtol=2e-6, atol=2e-6)
    assert torch.equal(fast[4:], torch.zeros_like(fast[4:]))  # padded rows stay zero


def test_plan_groups_similar_lengths():
    # blocks of 16: 36, 35, 20, 18, 9, 3, 1 blocks
    lens = [570, 560, 320, 288, 140, 40, 3]
    plan = plan_decode_reads(lens, 16, torch.device("cpu"))
    assert plan.num_read == 36
    # Up to half of 36 short joins the longest (20, 18); 9 starts a group; 3 is 6 short of
    # 9 (over the slack of 4 blocks) and starts one; 1 is within the slack of 3.
    assert plan.reads.tolist() == [36, 36, 36, 36, 9, 3, 3]
    assert sorted(sorted(rows) for rows, _ in plan.groups) == [[0, 1, 2, 3], [4], [5, 6]]
    assert plan_decode_reads([], 16, torch.device("cpu")).num_read == 0


def test_plan_keeps_small_padding_together():
    """A short request beside a long one still reads the long one's null-block padding
    while the difference is within the slack (the engine's null-block hazard test)."""
    plan = plan_decode_reads([40, 3], 16, torch.device("cpu"))
    assert plan.reads.tolist() == [3, 3] and len(plan.groups) == 1
    far = plan_decode_reads([16 * (2 * PAD_SLACK_BLOCKS + 2), 3], 16, torch.device("cpu"))
    assert far.reads.tolist() == [2 * PAD_SLACK_BLOCKS + 2, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_grouped_reads_match_the_grouped_reference(kvsentry_ops, dtype):
    query, k, v, tables, lens, num_read = make_case(batch=8, max_len=300, num_blocks=200, dtype=dtype,
                                                    lens=[300, 290, 150, 140, 60, 20, 5, 1])
    plan = plan_decode_reads(lens.tolist(), 16, torch.device("cpu"))
    assert len(plan.groups) > 1
    out = run_kernel(kvsentry_ops, query, k, v, tables, lens, plan.num_read, plan=plan)
    ref = run_reference(query, k, v, tables, lens, plan.num_read, plan=plan)
    torch.testing.assert_close(out.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])
    # Padding never changes a clean result: the same as every row reading the batch's longest.
    torch.testing.assert_close(out.float(), run_reference(query, k, v, tables, lens, num_read).float(),
                               rtol=TOL[dtype], atol=TOL[dtype])


def test_grouped_reads_spread_null_block_nan_within_groups_only(kvsentry_ops):
    query, k, v, tables, lens, num_read = make_case(batch=4, max_len=320, num_blocks=200,
                                                    lens=[320, 300, 150, 20])
    plan = plan_decode_reads(lens.tolist(), 16, torch.device("cpu"))
    assert plan.reads.tolist() == [20, 20, 20, 2]
    v[0, 0, 0, 0] = float("nan")
    out = run_kernel(kvsentry_ops, query, k, v, tables, lens, plan.num_read, plan=plan)
    ref = run_reference(query, k, v, tables, lens, plan.num_read, plan=plan)
    assert torch.equal(out.isnan(), ref.isnan())
    # Rows 1 and 2 read null entries up to their group's 20 blocks; row 3 (2 blocks) is
    # in a group of its own and reads none, nor does the longest.
    assert out.isnan().flatten(1).any(dim=1).tolist() == [False, True, True, False]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-deepseek-v3"])
def test_engine_outputs_match_with_and_without_the_kernel(kvsentry_ops, checkpoint, monkeypatch, preset):
    """The whole engine, kernel on (the default) and off (KVSENTRY_DISABLE_CPU_OPS=1, the
    torch reference): the same greedy tokens and logprobs for a mixed-length batch. For
    DeepSeek the kernel runs MLA decode (the latent cache as one shared kv head)."""
    from engine import LLM, SamplingParams
    path = checkpoint(preset)
    prompts = [list(range(5, 5 + n)) for n in (1, 7, 40, 90, 150)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    llm = LLM(path, max_model_len=256, kv_cache_memory="16MiB", block_size=16, dtype="float32")
    calls = []
    real, real_layers = cpu_ops.paged_decode_attention, cpu_ops.dense_decoder_layers
    monkeypatch.setattr(cpu_ops, "paged_decode_attention", lambda *a: (calls.append(1), real(*a)))
    # A dense model's steps run the kernel from inside the fused layer stack (fused_stack.py).
    monkeypatch.setattr(cpu_ops, "dense_decoder_layers", lambda *a: (calls.append(1), real_layers(*a))[1])
    fast = llm.generate(prompts, params)
    assert calls, "the engine did not use the kernel"
    # Read when a model loads (its attention backend is chosen once): a second engine, without them.
    monkeypatch.setenv("KVSENTRY_DISABLE_CPU_OPS", "1")
    calls.clear()
    slow = LLM(path, max_model_len=256, kv_cache_memory="16MiB", block_size=16, dtype="float32").generate(prompts, params)
    assert not calls
    assert len(fast) == len(slow) == len(prompts)
    for a, b in zip(fast, slow):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for token, x, y in zip(a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(x[token].logprob - y[token].logprob) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_prefill_rows_match_sdpa(kvsentry_ops, monkeypatch, dtype):
    """Decodes, a fresh prompt and a chunk after a cached prefix in one step: the kernel
    (prefill tokens as one-query rows with seq_len = position + 1) against the torch path
    (SDPA per request)."""
    lens = [120, 33, 45, 110]         # rows 0-1 decode; row 2 a fresh 45-token prompt; row 3 a
    new = [1, 1, 45, 30]              # 30-token chunk after 80 cached tokens
    query_all, k, v, tables, seq_lens, _ = make_case(batch=4, max_len=120, num_blocks=64, dtype=dtype, lens=lens)
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    g = torch.Generator().manual_seed(3)
    query = torch.randn(starts[-1] + 3, 8, 32, generator=g).to(dtype)  # 3 padded rows
    meta = AttentionMetadata(num_reqs=4, num_tokens=starts[-1], num_padded_tokens=query.shape[0],
                             slot_mapping=torch.full((query.shape[0],), -1), query_start_loc=torch.tensor(starts),
                             seq_lens=seq_lens, block_tables=tables, query_start_loc_cpu=starts,
                             seq_lens_cpu=lens, max_seq_len=max(lens))
    assert meta.num_decodes == 2
    plan = meta.prefill_plan(16, torch.device("cpu"))
    assert plan.seq_lens.tolist() == list(range(1, 46)) + list(range(81, 111))
    assert plan.reads.tolist()[:2] == [1, 1] and plan.reads.tolist()[-1] == 7
    fast = paged_attention(query, k, v, meta, 0.2)
    slow = paged_attention(query, k, v, meta, 0.2, AttentionBackend())
    torch.testing.assert_close(fast.float(), slow.float(), rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.equal(fast[starts[-1]:], torch.zeros_like(fast[starts[-1]:]))


@pytest.fixture
def bf16_dot(kvsentry_ops):
    """Turns the AVX512-BF16 scores on or off for one test, with the AMX path off so that the
    vector kernel runs every shape; restores the defaults after."""
    kvsentry_ops.cpu_attention_amx(False)
    yield kvsentry_ops.cpu_bf16_dot
    kvsentry_ops.cpu_bf16_dot(True)
    kvsentry_ops.cpu_attention_amx(True)


@pytest.mark.parametrize("use_dot", [True, False], ids=["bf16_dot", "widened"])
@pytest.mark.parametrize("heads, head_dim, block_size", [
    ((9, 3), 64, 16),    # the default model's shape
    ((4, 4), 96, 24),    # a partial 16-key tile per block
    ((8, 1), 32, 40),    # 8 query heads on one KV head, 2.5 tiles per block
    ((10, 1), 64, 8),    # 10 heads: the group too large for the shared value product
    ((6, 2), 48, 16),    # head_dim not a multiple of 32: no dot products
    ((80, 1), 32, 16),   # more heads per KV head than the tiled scores take
])
def test_score_paths_match_reference(kvsentry_ops, bf16_dot, use_dot, heads, head_dim, block_size):
    """The tiled scores (16 keys per shuffle reduction), with the bf16 dot products and
    without, against the reference. The dot-product case skips, saying so, where the CPU (or
    the build) has no AVX512-BF16: it would rerun the widened path."""
    if bf16_dot(use_dot) != use_dot:
        pytest.skip("no AVX512-BF16 on this CPU (or an AVX2 build): the bf16 dot products cannot run here")
    case = make_case(num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, block_size=block_size,
                     dtype=torch.bfloat16, num_blocks=200, max_len=130)
    out, ref = run_kernel(kvsentry_ops, *case), run_reference(*case)
    torch.testing.assert_close(out.float(), ref.float(), rtol=TOL[torch.bfloat16], atol=TOL[torch.bfloat16])
    f32 = [t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in case]
    torch.testing.assert_close(run_kernel(kvsentry_ops, *f32), run_reference(*f32), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
def test_full_tiles_give_the_generic_loops_bits(kvsentry_ops, bf16_dot, head_dim):
    """A block of 16 keys runs the unrolled bf16 dot products (one per head_dim above), a block
    of 8 the generic loop. The same keys in either layout give the same bits: each key's score
    is summed in the same order."""
    if not bf16_dot(True):
        pytest.skip("no AVX512-BF16 on this CPU (or an AVX2 build): the bf16 dot products cannot run here")
    g = torch.Generator().manual_seed(head_dim)
    batch, heads, kv_heads, length = 3, 6, 2, 80
    keys = torch.randn(batch, length, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    values = torch.randn(batch, length, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    query = torch.randn(batch, heads, head_dim, generator=g).to(torch.bfloat16)
    seq_lens = torch.tensor([length, 61, 17])
    outs = []
    for block_size in (16, 8):
        per = length // block_size
        # Request b's blocks are 1 + b * per ...; block 0 is the null block the tables pad with.
        k_cache = torch.zeros(1 + batch * per, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
        v_cache = torch.zeros_like(k_cache)
        k_cache[1:] = keys.reshape(batch * per, block_size, kv_heads, head_dim)
        v_cache[1:] = values.reshape(batch * per, block_size, kv_heads, head_dim)
        tables = (1 + torch.arange(batch * per, dtype=torch.int32)).view(batch, per)
        outs.append(run_kernel(kvsentry_ops, query, k_cache, v_cache, tables, seq_lens, per))
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


def test_bf16_dot_reports_the_cpu(kvsentry_ops, bf16_dot):
    """On when the CPU has AVX512-BF16 (and the build AVX-512), off when turned off."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists() or cpu_ops_capability() != "AVX512":
        pytest.skip("needs Linux's /proc/cpuinfo and an AVX-512 build")
    assert bf16_dot(None) == bool(re.search(r"\bavx512_bf16\b", cpuinfo.read_text()))
    assert bf16_dot(False) is False


@pytest.fixture
def amx(kvsentry_ops):
    """The AMX path (csrc/cpu/cpu_attention_amx.cpp) on this CPU, restored on after the test;
    skips where the CPU (or build) has no AMX-BF16."""
    if not kvsentry_ops.cpu_attention_amx(True):
        pytest.skip("no AMX-BF16 here: bf16 caches go through the vector kernel")
    yield kvsentry_ops.cpu_attention_amx
    kvsentry_ops.cpu_attention_amx(True)


@pytest.mark.parametrize("heads, head_dim, v_dim, block_size, lens", [
    ((9, 3), 64, 64, 16, None),              # the default model's shape
    ((32, 8), 128, 128, 16, None),           # a Llama-8B-like group of 4, four query tiles
    ((8, 1), 32, 32, 32, [77, 1, 31, 64]),   # 8 heads on one KV head, 2 score tiles per block
    ((16, 1), 96, 64, 64, [130, 3, 64, 65]),  # a full 16-head tile, 3 query tiles, v_dim != head_dim
    ((4, 4), 64, 32, 16, [33, 1, 16, 17]),   # MHA, v_dim 32: two value tiles
])
def test_amx_path_matches_reference_and_vector_kernel(kvsentry_ops, amx, heads, head_dim, v_dim, block_size, lens):
    """The AMX path against the reference (bf16 tolerance) and against the vector kernel on the
    same inputs: lengths inside a score tile, at a tile's edge, and a span that is not a whole
    value tile (zero padded)."""
    case = make_case(batch=len(lens) if lens else 6, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                     v_dim=v_dim, block_size=block_size, dtype=torch.bfloat16, num_blocks=300,
                     max_len=max(lens) if lens else 150, lens=lens)
    fast = run_kernel(kvsentry_ops, *case)
    ref = run_reference(*case)
    torch.testing.assert_close(fast.float(), ref.float(), rtol=TOL[torch.bfloat16], atol=TOL[torch.bfloat16])
    amx(False)
    vector = run_kernel(kvsentry_ops, *case)
    torch.testing.assert_close(fast.float(), vector.float(), rtol=TOL[torch.bfloat16], atol=TOL[torch.bfloat16])


@pytest.mark.parametrize("where", ["value", "key"])
def test_amx_path_spreads_null_block_nan_like_the_reference(kvsentry_ops, amx, where):
    """The null block's NaN through the AMX path: a NaN value poisons exactly the rows that
    read it with weight 0 (0 x NaN in the tile product), a NaN key is masked first."""
    query, k, v, tables, lens, num_read = make_case(batch=5, max_len=160, lens=[160, 3, 17, 40, 159],
                                                    head_dim=64, dtype=torch.bfloat16)
    (v if where == "value" else k)[0, 2, 1, 0] = float("nan")
    out, ref = run_kernel(kvsentry_ops, query, k, v, tables, lens, num_read), run_reference(
        query, k, v, tables, lens, num_read)
    assert torch.equal(out.isnan(), ref.isnan())
    assert out.isnan().flatten(1).any(dim=1).tolist() == (
        [False, True, True, True, False] if where == "value" else [False] * 5)
    torch.testing.assert_close(out.nan_to_num(0.0).float(), ref.nan_to_num(0.0).float(),
                               rtol=TOL[torch.bfloat16], atol=TOL[torch.bfloat16])


def test_amx_path_grouped_reads_and_a_real_nan(kvsentry_ops, amx):
    """Grouped reads (rows reading fewer entries than num_read) and a NaN key in a request's
    own block: that request's heads on that KV head only."""
    query, k, v, tables, lens, num_read = make_case(batch=8, max_len=300, num_blocks=200, dtype=torch.bfloat16,
                                                    head_dim=64, lens=[300, 290, 150, 140, 60, 20, 5, 1])
    plan = plan_decode_reads(lens.tolist(), 16, torch.device("cpu"))
    out = run_kernel(kvsentry_ops, query, k, v, tables, lens, plan.num_read, plan=plan)
    ref = run_reference(query, k, v, tables, lens, plan.num_read, plan=plan)
    torch.testing.assert_close(out.float(), ref.float(), rtol=TOL[torch.bfloat16], atol=TOL[torch.bfloat16])
    k[int(tables[2, 0]), 0, 0, 0] = float("nan")  # request 2's first key, kv head 0: heads 0-1
    out = run_kernel(kvsentry_ops, query, k, v, tables, lens, plan.num_read, plan=plan)
    assert out[2, :2].isnan().all() and not out[2, 2:].isnan().any()
    assert not torch.cat([out[:2], out[3:]]).isnan().any()


def test_amx_path_reports_the_cpu(kvsentry_ops):
    """On exactly where the CPU has AMX-BF16 (AVX-512 build); off when turned off."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists() or cpu_ops_capability() != "AVX512":
        pytest.skip("needs Linux's /proc/cpuinfo and an AVX-512 build")
    try:
        assert kvsentry_ops.cpu_attention_amx(None) == bool(re.search(r"\bamx_bf16\b", cpuinfo.read_text()))
        assert kvsentry_ops.cpu_attention_amx(False) is False
    finally:
        kvsentry_ops.cpu_attention_amx(True)
