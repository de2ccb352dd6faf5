"""A GGUF checkpoint's Q4_1 and Q8_0 linears run from their own blocks on CPU
(engine/models/cpu_gemm.py's quant_panels, csrc/cpu/cpu_quant_panels.h): the fused q|k|v and
gate|up, o_proj, down_proj and a tied LM head hold uint8 panels, and the engine serves exactly
the tokens and log-probs it serves from the plain panels (KVSENTRY_DISABLE_QUANT_PANELS=1)."""
from __future__ import annotations

import gguf
import pytest
import torch

from engine import LLM, SamplingParams
from engine.ops import registry
from engine.models.cpu_gemm import QUANT_PANEL_MAX_ROWS, QUANT_ROWS_BESIDE_DENSE, PackedLinear
from tests.engine.gguf_convert import write_gguf

Q = gguf.GGMLQuantizationType


def _quant_supported(dtype: torch.dtype) -> bool:
    from engine.ops import cpu_ops
    return (cpu_ops.available() and registry.has("quant_panels_supported")
            and bool(registry.op("quant_panels_supported")(dtype)))


def _packed(llm: LLM) -> list[PackedLinear]:
    model = llm.engine.runner.model
    return [p for layer in model.model.layers for p in (layer.self_attn.qkv, layer.self_attn.o_proj.packed,
                                                        layer.mlp.gate_up, layer.mlp.down_proj.packed)
            ] + [model.lm_head.packed]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linears_serve_what_the_plain_panels_serve(checkpoint, tmp_path, monkeypatch, dtype):
    if not _quant_supported(dtype):
        pytest.skip(f"no {dtype} quantized panels on this CPU")
    directory = checkpoint("tiny-llama")
    path = write_gguf(directory, tmp_path / "q.gguf",
                      qtype=lambda name, t: Q.Q8_0 if name.startswith(("token_embd", "output.")) else Q.Q4_1)
    prompts = [[5, 9, 33, 2, 17], list(range(40, 71)), list(range(3, 100, 2))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    args = dict(tokenizer=directory, max_model_len=256, kv_cache_memory="8MiB", num_threads=1,
                dtype=str(dtype).removeprefix("torch."), enable_prefix_caching=False,
                quantized_activations="none")
    quant = LLM(str(path), **{"dtype": "float32", **args})
    linears = _packed(quant)
    assert linears and all(p is not None and p.panels is not None and p.panels.dtype == torch.uint8
                           for p in linears), [None if p is None else p.panels.dtype for p in linears]
    # Past the plain panels' limit too, where they read fewer bytes than oneDNN's weight; or
    # (bf16 without AMX) up to a few rows, dense panels beyond: the prompts here take those.
    from engine.models.cpu_gemm import dense_panels_beside_quant
    beside = dense_panels_beside_quant(dtype)
    assert {p.panel_max_rows for p in linears} <= {None, QUANT_ROWS_BESIDE_DENSE if beside else QUANT_PANEL_MAX_ROWS[dtype]}
    assert all((p.wide_panels is not None) == beside for p in linears)
    from engine.models.cpu_gemm import rows_layout
    if rows_layout(dtype, int(Q.Q4_1)):  # AMX with AVX512-VBMI: the layers' Q4_1 in the rows layout
        assert all(p.panels.dim() == 4 and "(rows)" in p.path for p in linears[:-1]), [p.path for p in linears]
        assert linears[-1].panels.dim() == 3  # the Q8_0 head keeps the panel layout
    got = quant.generate(prompts, params)
    if rows_layout(dtype, int(Q.Q4_1)):
        monkeypatch.setenv("KVSENTRY_DISABLE_QUANT_ROWS", "1")
        panel_layout = LLM(str(path), **{"dtype": "float32", **args})
        assert all(p.panels.dim() == 3 for p in _packed(panel_layout))
        for ref, out in zip(panel_layout.generate(prompts, params), got):
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
            assert out.outputs[0].logprobs == ref.outputs[0].logprobs
        monkeypatch.delenv("KVSENTRY_DISABLE_QUANT_ROWS")
    monkeypatch.setenv("KVSENTRY_DISABLE_QUANT_PANELS", "1")
    plain = LLM(str(path), **{"dtype": "float32", **args})
    assert all(p.panels.dtype == dtype for p in _packed(plain))  # the same linears, dense panels
    want = plain.generate(prompts, params)
    for ref, out in zip(want, got):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].logprobs == ref.outputs[0].logprobs


def _q4_1_linear(seed: int) -> tuple[torch.Tensor, PackedLinear]:
    """A 96 x 64 bf16 weight from Q4_1 blocks, and its PackedLinear over those blocks."""
    import numpy as np

    from engine.gguf.weights import QuantRows
    values = np.random.default_rng(seed).standard_normal((96, 64)).astype(np.float32) * 0.2
    raw = np.ascontiguousarray(gguf.quantize(values, Q.Q4_1))
    weight = torch.from_numpy(np.array(gguf.dequantize(raw, Q.Q4_1), dtype=np.float32)).bfloat16()
    return weight, PackedLinear(weight, None, QuantRows(int(Q.Q4_1), 64, torch.from_numpy(raw)))


def test_quantized_linear_keeps_onednn_past_its_row_limit_on_amx():
    """On AMX CPUs, quantized bf16 panels serve up to QUANT_PANEL_MAX_ROWS rows and oneDNN's
    dense copy beyond; the panels' results are the dense panels' bit for bit."""
    from engine.models import cpu_gemm
    if not (_quant_supported(torch.bfloat16) and cpu_gemm.onednn_supports(torch.zeros(64, 32).bfloat16())):
        pytest.skip("no bf16 quantized panels or no oneDNN bf16 here")
    if "amx" not in registry.op("bf16_gemm_kernels")():
        pytest.skip("no AMX here")
    weight, packed = _q4_1_linear(5)
    limit = QUANT_PANEL_MAX_ROWS[torch.bfloat16]
    assert packed.panels.dtype == torch.uint8 and packed.onednn and packed.panel_max_rows == limit
    assert packed.wide_panels is None
    dense = registry.op("bf16_gemm_pack")(weight)
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    for rows in (1, limit, limit + 1):
        x = torch.randn(rows, 64).bfloat16()
        want = (registry.op("bf16_gemm")(x, dense, None, 96) if rows <= limit
                else torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [None], ""))
        assert packed.uses_panels(rows) == (rows <= limit)
        assert torch.equal(packed(x), want)


def test_quantized_linear_beside_dense_panels_without_amx(monkeypatch):
    """On CPUs with AVX512-BF16 and no AMX (Zen 4/5; simulated on an AMX CPU by hiding the flag),
    bf16 GGUF blocks serve steps of up to QUANT_ROWS_BESIDE_DENSE rows and dense panels, not
    oneDNN, every larger one (cpu_gemm.dense_panels_beside_quant): both give the dense panels'
    bits, so a sequence's tokens do not depend on which one its step took."""
    from engine.ops import cpu_ops
    if not _quant_supported(torch.bfloat16) or "avx512_bf16" not in cpu_ops.cpu_flags():
        pytest.skip("no bf16 quantized panels or no AVX512-BF16 here")
    flags = cpu_ops.cpu_flags() - {"amx_bf16"}
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: flags)
    weight, packed = _q4_1_linear(5)
    assert packed.panels.dtype == torch.uint8 and not packed.onednn
    assert packed.panel_max_rows == QUANT_ROWS_BESIDE_DENSE and packed.wide_panels.dtype == torch.bfloat16
    dense = registry.op("bf16_gemm_pack")(weight)
    assert torch.equal(packed.wide_panels, dense) and packed.large_weight is packed.wide_panels
    for rows in (1, QUANT_ROWS_BESIDE_DENSE, QUANT_ROWS_BESIDE_DENSE + 1, 8, 300):
        x = torch.randn(rows, 64).bfloat16()
        assert packed.uses_panels(rows) == (rows <= QUANT_ROWS_BESIDE_DENSE)
        assert torch.equal(packed(x), registry.op("bf16_gemm")(x, dense, None, 96)), rows
        assert torch.equal(registry.op("bf16_gemm")(x, packed.panels, None, 96),
                           registry.op("bf16_gemm")(x, dense, None, 96)), rows


def test_quantized_linear_alone_where_bf16_multiplies_in_float32(monkeypatch):
    """On CPUs with AVX-512F but no AVX512-BF16 (simulated here where the CPU has more), oneDNN's
    bf16 is an emulation (~30 GFLOP/s on one Xeon core against ~140 for the panels), so the
    quantized panels serve every size and no dense copy is kept; on such a CPU bf16_gemm's
    best kernel is "avx512f", whose results are the dense panels' bit for bit."""
    from engine.models import cpu_gemm
    from engine.ops import cpu_ops
    if not _quant_supported(torch.bfloat16):
        pytest.skip("no bf16 quantized panels here")
    flags = cpu_ops.cpu_flags() - {"amx_bf16"}
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu_gemm, "bf16_float32_fmas", lambda dtype: dtype == torch.bfloat16)
    weight, packed = _q4_1_linear(6)
    assert packed.panels.dtype == torch.uint8 and not packed.onednn and packed.panel_max_rows is None
    assert packed.wide_panels is None
    dense = registry.op("bf16_gemm_pack")(weight)
    for rows in (1, 129, 300):
        x = torch.randn(rows, 64).bfloat16()
        assert packed.uses_panels(rows)
        for kernel in registry.op("bf16_gemm_kernels")():
            assert torch.equal(registry.debug_ops().bf16_gemm_with(x, packed.panels, None, 96, kernel),
                               registry.debug_ops().bf16_gemm_with(x, dense, None, 96, kernel)), (rows, kernel)
        torch.testing.assert_close(packed(x).float(), (x.float() @ weight.float().T), rtol=2e-2, atol=2e-2)
