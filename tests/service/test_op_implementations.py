"""Which implementation each op runs is exported (an info metric) and logged per rank, so a
kernel that failed to build and left an op on the torch reference is seen, not silent."""
from __future__ import annotations

import json

import msgspec

from engine.messages import RankReady
from engine.ops import implementations
from engine.ops.implementations import TORCH_REFERENCE, describe, falling_back, op_implementations
from service.metrics import Metrics

METRIC = "kvsentry_op_implementation_info"


def test_every_op_is_reported_on_every_device():
    for device in ("cpu", "cuda", "meta"):
        assert set(op_implementations(device)) == set(implementations.KERNELS)
    assert op_implementations("meta") == dict.fromkeys(implementations.KERNELS, TORCH_REFERENCE)


def test_a_disabled_kernel_is_reported_as_a_fallback(monkeypatch):
    monkeypatch.setenv("KVSENTRY_DISABLE_CPU_OPS", "1")
    ops = op_implementations("cpu")
    assert ops["paged_attention"] == TORCH_REFERENCE
    # The writers, checksum and scan kernels are in the same library: disabled with it.
    assert falling_back(ops, "cpu") == ["paged_attention", "kv_writer", "kv_checksum", "kv_nan_scan"]
    assert describe(ops) == ("paged_attention=torch_reference kv_writer=torch_reference "
                             "kv_checksum=torch_reference kv_nan_scan=torch_reference")


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
    assert len(server.metric(METRIC, engine="0")) == len(expected)
    lines = [json.loads(line) for line in server.log_text().splitlines() if '"rank_ops"' in line]
    assert [(line["rank"], line["ops"]) for line in lines] == [(0, describe(expected))]
