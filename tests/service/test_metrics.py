"""The per-rank KV integrity metrics, rendered from StepStats: NaN sentinel, sealed-block
checksums and foreign writes (no server: Metrics is fed StepStats directly)."""
from __future__ import annotations

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.integrity.stats import IntegrityStats
from engine.messages import StepStats
from service.metrics import Metrics


def step_stats(rank: int = 0, **fields) -> StepStats:
    """StepStats of `rank`; fields of IntegrityStats go into its `integrity`."""
    base = dict(rank=rank, steps=10, dummy_batches=0, padded_tokens=0, num_running=0, num_waiting=0,
                kv_usage=0.0, prefix_queries=0, prefix_hits=0, preemptions=0)
    names = {f.name for f in msgspec.structs.fields(IntegrityStats)}
    integrity = IntegrityStats(**{k: v for k, v in fields.items() if k in names})
    return StepStats(**(base | {k: v for k, v in fields.items() if k not in names}), integrity=integrity)


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, frozenset({"model_name": "m", **labels}.items()))]


def test_an_idle_rank_exports_every_integrity_series_at_zero():
    # Both mismatch regions exist from start-up, even when the rank has reported none,
    # so that increase() sees the first mismatch.
    text = Metrics("m", lambda: {0: step_stats()}).render().decode()
    for region in ("prefix_cache", "running"):
        assert value(text, "kvsentry_kv_cache_checksum_mismatches_total", engine="0", region=region) == 0
    assert value(text, "kvsentry_kv_foreign_writes_total", engine="0") == 0
    assert value(text, "kvsentry_kv_cache_sealed_blocks", engine="0") == 0
    assert value(text, "kvsentry_kv_cache_checksum_coverage_steps", engine="0") == 0
    assert "# TYPE kvsentry_kv_cache_checksum_mismatches_total counter" in text
    assert "# TYPE kvsentry_kv_foreign_writes_total counter" in text
    assert "# TYPE kvsentry_kv_cache_sealed_blocks gauge" in text
    assert "# TYPE kvsentry_kv_cache_checksum_coverage_steps gauge" in text
    assert "# TYPE kvsentry_kv_cache_checksum_seconds histogram" in text


def test_checksum_and_foreign_write_series_per_rank_and_region():
    stats = {0: step_stats(0, checksum_mismatches=[("prefix_cache", 0), ("running", 2)], foreign_writes=5,
                           sealed_blocks=37, checksum_coverage_steps=3),
             1: step_stats(1, checksum_mismatches=[("prefix_cache", 1)], sealed_blocks=4,
                           checksum_coverage_steps=1)}
    text = Metrics("m", lambda: stats).render().decode()
    assert value(text, "kvsentry_kv_cache_checksum_mismatches_total", engine="0", region="running") == 2
    assert value(text, "kvsentry_kv_cache_checksum_mismatches_total", engine="0", region="prefix_cache") == 0
    assert value(text, "kvsentry_kv_cache_checksum_mismatches_total", engine="1", region="prefix_cache") == 1
    assert value(text, "kvsentry_kv_cache_checksum_mismatches_total", engine="1", region="running") == 0
    assert value(text, "kvsentry_kv_foreign_writes_total", engine="0") == 5
    assert value(text, "kvsentry_kv_foreign_writes_total", engine="1") == 0
    assert value(text, "kvsentry_kv_cache_sealed_blocks", engine="0") == 37
    assert value(text, "kvsentry_kv_cache_sealed_blocks", engine="1") == 4
    assert value(text, "kvsentry_kv_cache_checksum_coverage_steps", engine="0") == 3
    # A checksum mismatch is not a NaN: the NaN series are untouched.
    assert 'kvsentry_kv_cache_nan_detections_total{' not in text  # the rank reported no NaN regions


def test_seal_and_verify_seconds_are_histogram_observations_by_phase():
    metrics = Metrics("m", dict)
    metrics.observe_stats(step_stats(0, seal_seconds=[2e-5, 5e-4], verify_seconds=[0.002]))
    metrics.observe_stats(step_stats(0, verify_seconds=[0.02]))
    metrics.observe_stats(step_stats(1, seal_seconds=[1e-4]))
    text = metrics.render().decode()
    name = "kvsentry_kv_cache_checksum_seconds"
    assert value(text, f"{name}_count", engine="0", phase="seal") == 2
    assert value(text, f"{name}_count", engine="0", phase="verify") == 2
    assert value(text, f"{name}_sum", engine="0", phase="verify") == pytest.approx(0.022)
    assert value(text, f"{name}_bucket", engine="0", phase="seal", le="0.0001") == 1
    assert value(text, f"{name}_count", engine="1", phase="seal") == 1
    assert (f"{name}_count", frozenset({"model_name": "m", "engine": "1", "phase": "verify"}.items())) \
        not in samples(text)
    # The scan histogram is the sentinel's alone.
    assert "kvsentry_kv_cache_scan_seconds_count{" not in text
