"""Which implementation each op runs is exported (an info metric) and logged per rank, so a
kernel that failed to build and left an op on the torch reference is seen, not silent."""
from __future__ import annotations

import json

import msgspec

from engine.messages import RankReady
from engine.ops import registry
from engine.ops.implementations import describe, falling_back, graphs_entry, op_implementations
from engine.ops.registry import TORCH_REFERENCE
from service.metrics import Metrics

METRIC = "kvsentry_op_implementation_info"


def test_every_op_is_reported_on_every_device():
    for device in ("cpu", "cuda", "meta"):
        assert list(op_implementations(device)) == list(registry.OPS)
    assert op_implementations("meta") == {op: registry.fallback_of(op) for op in registry.OPS}
    assert op_implementations("meta")["bf16_gemm"] == "onednn"


def test_a_disabled_kernel_is_reported_as_a_fallback(monkeypatch):
    monkeypatch.setenv("KVSENTRY_DISABLE_CPU_OPS", "1")
    ops = op_implementations("cpu")
    assert ops["paged_attention"] == TORCH_REFERENCE
    # Every CPU row is in the same library: all of them are off with it, each on its fallback.
    cpu_rows = [k.op for k in registry.KERNELS if k.device == "cpu"]
    assert falling_back(ops, "cpu") == cpu_rows
    assert describe(ops) == "; ".join(f"{op}={registry.fallback_of(op)}" for op in registry.OPS)


def test_cuda_graphs_off_is_a_fallback_unless_the_operator_asked():
    assert falling_back({"cuda_graphs": graphs_entry(None)}, "cuda") == []
    assert falling_back({"cuda_graphs": graphs_entry("--enforce-eager")}, "cuda") == []
    assert falling_back({"cuda_graphs": graphs_entry("torch has no FlexAttention")}, "cuda") == ["cuda_graphs"]
    assert falling_back({"cuda_graphs": graphs_entry("not a CUDA device")}, "cpu") == []


def test_the_ready_message_carries_them():
    ready = RankReady(1, 10, 123, {"paged_attention": "cpu_kernel"})
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(ready), type=RankReady) == ready
    assert RankReady(1, 10, 123).op_implementations == {}


def test_the_metric_has_one_series_per_rank_and_op():
    ops = {"paged_attention": "cpu_kernel", "kv_writer": TORCH_REFERENCE}
    text = Metrics("m", dict, lambda: {0: ops, 1: ops}).render().decode()
    assert f'{METRIC}{{engine="1",implementation="cpu_kernel",model_name="m",op="paged_attention"}} 1.0' in text
    assert text.count(f"{METRIC}{{") == 4


def test_a_running_server_exports_and_logs_them(server):
    expected = op_implementations("cpu")  # the test session builds the CPU kernels before any server starts
    for op, implementation in expected.items():
        assert server.metric(METRIC, engine="0", op=op, implementation=implementation) == [1.0], op
    lines = [json.loads(line) for line in server.log_text().splitlines() if '"rank_ops"' in line]
    assert [line["rank"] for line in lines] == [0]
    logged = dict(item.split("=", 1) for item in lines[0]["ops"].split("; "))
    # Every registry op, then what the runner chose at load: each linear kind's GEMM path and
    # CUDA graphs (off on a CPU, saying why); the metric has a series for each entry.
    assert {op: logged[op] for op in expected} == expected
    kinds = sorted(name for name in logged if name.startswith("linear."))
    assert {"linear.qkv", "linear.o_proj", "linear.gate_up", "linear.down_proj"} <= set(kinds), kinds
    assert logged["cuda_graphs"] == "off: not a CUDA device"
    assert logged["layer_stack"] == "fused_stack"  # a dense model on CPU with the kernels
    assert len(server.metric(METRIC, engine="0")) == len(logged)
    for name in kinds:
        assert server.metric(METRIC, engine="0", op=name, implementation=logged[name]) == [1.0], name
