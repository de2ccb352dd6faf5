"""csrc/cpu/cpu_decoder_layers.cpp (the dense_decoder_layers op, run by
engine/models/fused_stack.py) against the Python layer loop it replaces (the same bits), and
both against torch alone.

Each case drives three engines on one checkpoint through the same steps -- decodes, prompts
short enough for the kernel's prefill rows, a long prompt that takes the loop (SDPA) mid-run,
padding and dummy batches: one with the fused stack, one with `enforce_eager` (the loop), whose
every step's hidden states, KV cache and sampled tokens must be bitwise equal; and a reference
with every csrc/ kernel off (KVSENTRY_DISABLE_CPU_OPS=1: oneDNN's GEMMs, torch's attention,
norms and KV writer), which calls none of the kernels, so a kernel bug shared by the op and the
loop shows there: float32 within 1e-3 at every step with the same tokens, bf16 within bf16's
rounding on the first step (later steps may sample another token at a near-tie). Needs the
ops built (`kvsentry_ops`)."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine_core.engine_core import EngineCore
from engine.messages import EngineRequest
from engine.models import cpu_gemm
from engine.ops import attention_backends as attention
from engine.ops import cpu_ops
from engine.sampling_params import SamplingParams

DTYPES = [torch.float32, torch.bfloat16]


def engines(path: str, dtype: torch.dtype, **kwargs) -> tuple[EngineCore, EngineCore]:
    args = dict(max_model_len=256, num_gpu_blocks=96, block_size=16, dtype=str(dtype).removeprefix("torch."),
                enable_prefix_caching=False)
    args.update(kwargs)
    fused = EngineCore(EngineConfig.create(path, **{"dtype": "float32", **args}))
    eager = EngineCore(EngineConfig.create(path, enforce_eager=True, **{"dtype": "float32", **args}))
    assert fused.runner.model.model.fused is not None, "the fused stack was not built"
    assert eager.runner.model.model.fused is None
    return fused, eager


def record_hidden(core: EngineCore) -> list[torch.Tensor]:
    """Every forward's final hidden states, in order."""
    seen: list[torch.Tensor] = []
    norm = core.runner.model.model.norm
    norm.register_forward_hook(lambda module, args, out: seen.append(args[0].clone()))
    return seen


def add(core: EngineCore, rid: str, prompt: list[int], max_tokens: int) -> None:
    core.add_request(EngineRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                               ignore_eos=True, logprobs=2)))


def run_plan(core: EngineCore, plan) -> list:
    outputs = []
    for action, arg in plan:
        if action == "add":
            add(core, *arg)
        elif action == "dummy":
            core.run_dummy(arg)
        else:
            for _ in range(arg):
                for out in core.step():
                    lp = out.new_logprobs[0] if out.new_logprobs else None
                    outputs.append((out.request_id, out.new_token_ids,
                                    None if lp is None else (lp.logprob, lp.top)))
    return outputs


def mixed_plan(vocab: int) -> list:
    g = torch.Generator().manual_seed(1)

    def prompt(n: int) -> list[int]:
        return torch.randint(5, vocab, (n,), generator=g).tolist()
    long = attention.PREFILL_SDPA_MIN_TOKENS + 11
    return [("add", ("a", prompt(1), 12)), ("add", ("b", prompt(7), 12)), ("step", 2),
            ("add", ("c", prompt(40), 10)), ("step", 1), ("dummy", 8),
            ("add", ("d", prompt(long), 6)),  # a chunk for SDPA: that step runs the loop
            ("step", 3), ("add", ("e", prompt(17), 8)), ("step", 4), ("dummy", 3), ("step", 20)]


def assert_fused_equals_loop(path, dtype, monkeypatch) -> EngineCore:
    """Runs mixed_plan through a fused and an enforce_eager engine: every step's hidden states,
    the cache and the outputs must be bitwise equal. Prompt "d"'s chunk takes the loop (SDPA),
    unless a tiled prefill kernel takes its shapes (attention.prefill_in_tiles): then it stays in
    the op.
    Returns the fused engine."""
    monkeypatch.setattr(attention, "PREFILL_KERNEL_MAX_LEN", 0)  # prompt "d": not the kernel's rows
    fused, eager = engines(path, dtype)
    model = fused.config.model
    k, v = fused.runner.kv_caches[0]
    loop_steps = 0 if attention.prefill_in_tiles(dtype, model.num_heads, model.head_dim, k, v) else 1
    calls = []
    real = cpu_ops.dense_decoder_layers
    monkeypatch.setattr(cpu_ops, "dense_decoder_layers", lambda *a: (calls.append(1), real(*a))[1])
    hidden_fused, hidden_eager = record_hidden(fused), record_hidden(eager)
    plan = mixed_plan(fused.config.model.vocab_size)
    out_fused = run_plan(fused, plan)
    n_fused = len(calls)
    out_eager = run_plan(eager, plan)
    assert len(calls) == n_fused, "the enforce_eager engine called the fused op"
    assert len(hidden_fused) == len(hidden_eager) and n_fused == len(hidden_fused) - loop_steps
    for step, (a, b) in enumerate(zip(hidden_fused, hidden_eager)):
        assert torch.equal(a, b), f"step {step}: hidden states differ"
    assert torch.equal(fused.runner.kv_storage.view(torch.uint8), eager.runner.kv_storage.view(torch.uint8))
    assert out_fused == out_eager
    assert int(fused.runner.null_block_writes) == int(eager.runner.null_block_writes) == 0
    assert_near_torch_alone(path, dtype, plan, hidden_fused, out_fused, monkeypatch)
    return fused


def assert_near_torch_alone(path, dtype, plan, hidden_fused, out_fused, monkeypatch) -> None:
    """The plan on an engine with the csrc/ kernels off: the fused engine's results within the
    summation-order error of another GEMM and attention (the references are not bitwise theirs)."""
    calls = []
    real = cpu_ops.dense_decoder_layers
    monkeypatch.setattr(cpu_ops, "dense_decoder_layers", lambda *a: (calls.append(1), real(*a))[1])
    monkeypatch.setenv("KVSENTRY_DISABLE_CPU_OPS", "1")  # read per call by the writers and norms too
    try:
        reference = EngineCore(EngineConfig.create(path, max_model_len=256, num_gpu_blocks=96, block_size=16,
                                                   dtype=str(dtype).removeprefix("torch."),
                                                   enable_prefix_caching=False))
        assert reference.runner.model.model.fused is None and reference.runner.attention.name == "torch_reference"
        hidden_reference = record_hidden(reference)
        out_reference = run_plan(reference, plan)
    finally:
        monkeypatch.delenv("KVSENTRY_DISABLE_CPU_OPS")
    assert calls == []
    assert len(hidden_reference) == len(hidden_fused)
    if dtype == torch.float32:
        for step, (a, b) in enumerate(zip(hidden_fused, hidden_reference)):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3, msg=lambda m: f"step {step}: {m}")
        assert [(rid, tokens) for rid, tokens, _ in out_fused] == [(rid, tokens) for rid, tokens, _ in out_reference]
    else:  # one rounding of bf16 (2^-8 relative) per op apart, on the step before any sampling
        torch.testing.assert_close(hidden_fused[0].float(), hidden_reference[0].float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_fused_stack_equals_the_layer_loop(kvsentry_ops, checkpoint, preset, dtype, monkeypatch):
    """Llama, Qwen2 (q|k|v bias) and Qwen3 (per-head q/k norms), float32 and bf16: every
    step's hidden states, the cache and the outputs are bitwise those of the loop."""
    assert_fused_equals_loop(checkpoint(preset, num_hidden_layers=3), dtype, monkeypatch)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_tiled_prefill_chunks_stay_in_the_op(kvsentry_ops, checkpoint, dtype, monkeypatch):
    """A chunk past the kernel's rows runs on the tiled prefill kernel (AMX for bf16 on AMX CPUs,
    AVX-512F vectors otherwise) inside the op (no step takes the loop), with the loop's bits:
    head_dim 32, a shape both kernels take."""
    empty = torch.empty(1, 16, 2, 32, dtype=dtype)
    if not attention.prefill_in_tiles(dtype, 4, 32, empty, empty):
        pytest.skip("no tiled prefill kernel here: such chunks go through SDPA, in the loop")
    path = checkpoint("tiny-llama", num_hidden_layers=3, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    calls = []
    real = cpu_ops.paged_prefill_attention
    monkeypatch.setattr(cpu_ops, "paged_prefill_attention", lambda *a: calls.append(1) or real(*a))
    assert_fused_equals_loop(path, dtype, monkeypatch)
    assert calls, "the loop (enforce_eager) never ran the tiled prefill kernel"


def test_both_weight_copies_pick_by_step_size_as_the_loop_does(kvsentry_ops, checkpoint, monkeypatch):
    """Where the linears keep bf16 panels and oneDNN's weight (AMX CPUs: panels up to
    cpu_gemm.AMX_PANEL_MAX_ROWS rows), the op takes the panels for steps of up to that many
    tokens and oneDNN's weights beyond, as every PackedLinear call in the loop does: here with
    the limit at 16 tokens, so that the plan's decode steps and its 17- and 40-token prompts
    take both (on any CPU with the panels: bf16_gemm runs its best kernel)."""
    if not kvsentry_ops.bf16_gemm_supported() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no bf16 panels or no oneDNN bf16 here: a linear holds one copy")
    monkeypatch.setattr(cpu_gemm, "panel_max_rows", lambda dtype, quantized=False: 16)
    fused = assert_fused_equals_loop(checkpoint("tiny-llama", num_hidden_layers=3), torch.bfloat16, monkeypatch)
    stack = fused.runner.model.model.fused
    assert stack.panel_rows == 16 and stack.weights[1].is_mkldnn and not stack.panel_weights[1].is_mkldnn


def test_dummy_and_padded_rows_write_nothing(kvsentry_ops, checkpoint):
    """PAD_SLOT_ID rows through the fused op: a dummy batch leaves the cache's bytes as they
    were, and a step padded past its real tokens writes only the real tokens' slots."""
    path = checkpoint("tiny-llama", num_hidden_layers=2)
    fused, _ = engines(path, torch.float32)
    add(fused, "a", list(range(5, 25)), 4)
    fused.step()
    before = fused.runner.kv_storage.clone()
    fused.run_dummy(16)
    assert torch.equal(before.view(torch.int32), fused.runner.kv_storage.view(torch.int32))
    sched = fused.schedule()
    fused.step(sched, num_padded=sched.num_tokens + 7)
    changed = before.view(torch.int32) != fused.runner.kv_storage.view(torch.int32)
    # storage [L, 2, Hkv, NB, bs, D] -> the slots (NB * bs) any layer's K or V changed in
    touched = changed.any(dim=-1).flatten(0, 2).any(dim=0).flatten().nonzero().flatten().tolist()
    (request, _), = sched.scheduled
    slot = request.block_ids[1] * 16 + 20 % 16  # position 20: the decoded token
    assert touched == [slot]
    assert int(fused.runner.null_block_writes) == 0


def test_hooks_and_enforce_eager_take_the_loop(kvsentry_ops, checkpoint, monkeypatch):
    """A forward hook on any layer module sends the step through the loop (so the hook
    fires); --enforce-eager never builds the stack; a MoE model never gets one."""
    path = checkpoint("tiny-llama", num_hidden_layers=2)
    fused, _ = engines(path, torch.float32)
    calls, fired = [], []
    real = cpu_ops.dense_decoder_layers
    monkeypatch.setattr(cpu_ops, "dense_decoder_layers", lambda *a: (calls.append(1), real(*a))[1])
    add(fused, "a", list(range(5, 12)), 3)
    fused.step()
    assert calls == [1]
    handle = fused.runner.model.model.layers[1].mlp.register_forward_hook(lambda *a: fired.append(1))
    fused.step()
    assert calls == [1] and fired == [1]
    handle.remove()
    fused.step()
    assert calls == [1, 1]
    moe = EngineCore(EngineConfig.create(checkpoint("tiny-mixtral"), max_model_len=128, num_gpu_blocks=32, dtype="float32"))
    assert moe.runner.model.model.fused is None


def test_op_checks_its_arguments(kvsentry_ops):
    hidden = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="6 tensors per layer"):
        kvsentry_ops.dense_decoder_layers(
            hidden, torch.zeros(2, dtype=torch.int64), [hidden], [None] * 4, [8] * 4, [], [torch.zeros(4, 16, 1, 8)],
            [torch.zeros(4, 16, 1, 8)], torch.zeros(8, 8), torch.zeros(8, 8), torch.full((2,), -1), None,
            None, None, None, 0, 0, None, None, None, 0, 0, 0, 1, 1, 8, 1e-6, 1.0)
