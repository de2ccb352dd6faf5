"""Prometheus metrics of one server, in their own registry (tests build many apps).

Request metrics are updated by the handlers; per-rank gauges are read from the
client's latest `StepStats` at scrape time by `EngineStatsCollector`. A rank
reports on a finding at once, otherwise at most every STATS_SECONDS while busy
and when it goes idle (engine/dp/rank.py). Every series carries `model_name`;
the per-rank ones also carry `engine` (the DP rank).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.integrity.regions import CHECKSUM_REGIONS
from engine.messages import StepStats
from service.supervisor_metrics import SupervisionCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)

StatsSource = Callable[[], dict[int, StepStats]]
OpsSource = Callable[[], dict[int, dict[str, str]]]  # rank -> {op: implementation}


class EngineStatsCollector(Collector):
    """Per-rank gauges and counters from the ranks' latest StepStats."""

    def __init__(self, model_name: str, stats: StatsSource):
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = dict(self.stats())
        yield self._gauge("kvsentry_num_requests_running", "Requests in the running batch of a DP rank.",
                          stats, lambda s: s.num_running)
        yield self._gauge("kvsentry_num_requests_waiting", "Requests waiting to be scheduled on a DP rank.",
                          stats, lambda s: s.num_waiting)
        yield self._gauge("kvsentry_kv_cache_usage_perc",
                          "Fraction of KV cache blocks in use on a DP rank (1 = full).",
                          stats, lambda s: s.kv_usage)
        yield self._counter("kvsentry_prefix_cache_queries", "Blocks looked up in the prefix cache.",
                            stats, lambda s: s.prefix_queries)
        yield self._counter("kvsentry_prefix_cache_hits", "Blocks found in the prefix cache.",
                            stats, lambda s: s.prefix_hits)
        yield self._counter("kvsentry_num_preemptions", "Requests preempted for lack of KV blocks.",
                            stats, lambda s: s.preemptions)
        yield self._counter("kvsentry_engine_steps", "Engine steps run (dummy batches included).",
                            stats, lambda s: s.steps)
        yield self._counter("kvsentry_dummy_batches", "Dummy batches run by idle ranks during a wave.",
                            stats, lambda s: s.dummy_batches)
        yield self._counter("kvsentry_padded_tokens", "Padding tokens added to batches (dummy batches included).",
                            stats, lambda s: s.padded_tokens)
        # The mission metrics: what the NaN sentinel sees in each rank's KV cache.
        nan_values = GaugeMetricFamily("kvsentry_kv_cache_nan_values",
                                       "Non-finite values in the KV cache at the last scan, per layer and "
                                       "region (null_block = block 0, allocated = every other block).",
                                       labels=["model_name", "engine", "layer", "region"])
        for rank, s in sorted(stats.items()):
            for layer, region, value in s.integrity.nan_values:
                nan_values.add_metric([self.model_name, str(rank), str(layer), region], float(value))
        yield nan_values
        yield self._region_counter("kvsentry_kv_cache_nan_detections", "Blocks the NaN sentinel found newly poisoned.",
                                   stats, lambda s: s.integrity.nan_detections, ())
        yield self._counter("kvsentry_null_block_writes",
                            "Cache writes whose slot fell in the null block (block 0); must stay 0.",
                            stats, lambda s: s.integrity.null_block_writes)
        yield self._counter("kvsentry_corrupted_requests",
                            "Requests with non-finite logits or aborted for reading a poisoned block.",
                            stats, lambda s: s.integrity.corrupted_requests)
        yield self._counter("kvsentry_kv_cache_heals",
                            "Poisoned blocks zeroed (and dropped from the prefix cache) by --nan-policy heal.",
                            stats, lambda s: s.integrity.heals)
        yield self._gauge("kvsentry_kv_cache_scan_coverage_steps",
                          "Steps within which the sentinel scans every KV block at least once.",
                          stats, lambda s: s.integrity.scan_coverage_steps)
        # Beyond NaN: finite corruption of sealed (full, immutable) blocks, and cache writes
        # outside the blocks of the step's own requests.
        yield self._region_counter("kvsentry_kv_cache_checksum_mismatches",
                                   "Sealed KV blocks whose bytes no longer match their checksum "
                                   "(finite corruption), by region (prefix_cache or running).",
                                   stats, lambda s: s.integrity.checksum_mismatches, CHECKSUM_REGIONS)
        yield self._gauge("kvsentry_kv_cache_sealed_blocks",
                          "KV blocks sealed (full, immutable) with a recorded checksum on a DP rank.",
                          stats, lambda s: s.integrity.sealed_blocks)
        yield self._gauge("kvsentry_kv_cache_checksum_coverage_steps",
                          "Steps within which the checksum sweep verifies every sealed block at least once.",
                          stats, lambda s: s.integrity.checksum_coverage_steps)
        yield self._counter("kvsentry_kv_foreign_writes",
                            "Cache writes whose slot fell outside the blocks the step's scheduled requests "
                            "own (e.g. a stale slot buffer in a dummy or padded batch); must stay 0.",
                            stats, lambda s: s.integrity.foreign_writes)

        yield from self._spec_decode(stats)

    def _spec_decode(self, stats: dict[int, StepStats]) -> Iterator[Metric]:
        """Speculative decoding (engine/spec_decode/), vLLM's names; all 0 when it is off."""
        yield self._counter("kvsentry_spec_decode_num_drafts", "Verify steps of a request with draft tokens.",
                            stats, lambda s: s.spec_decode.num_drafts)
        yield self._counter("kvsentry_spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                            stats, lambda s: s.spec_decode.num_draft_tokens)
        yield self._counter("kvsentry_spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                            stats, lambda s: s.spec_decode.num_accepted_tokens)
        yield self._counter("kvsentry_spec_decode_num_emitted_tokens",
                            "Tokens emitted by verify steps (accepted drafts plus one each).",
                            stats, lambda s: s.spec_decode.num_emitted_tokens)
        per_pos = CounterMetricFamily("kvsentry_spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position (0 = the first).",
                                      labels=["model_name", "engine", "position"])
        for rank, s in sorted(stats.items()):
            for position, count in enumerate(s.spec_decode.accepted_per_pos):
                per_pos.add_metric([self.model_name, str(rank), str(position)], float(count))
        yield per_pos
        yield self._gauge("kvsentry_spec_decode_acceptance_rate",
                          "Accepted / proposed draft tokens since start-up on a DP rank.",
                          stats, lambda s: s.spec_decode.acceptance_rate)
        yield self._gauge("kvsentry_spec_decode_mean_accepted_tokens_per_step",
                          "Tokens a verify step emits on average since start-up (1 = no gain).",
                          stats, lambda s: s.spec_decode.mean_accepted_per_step)

    def _region_counter(self, name: str, doc: str, stats: dict[int, StepStats],
                        totals: Callable[[StepStats], list[tuple[str, int]]],
                        regions: tuple[str, ...]) -> CounterMetricFamily:
        """A counter per (rank, region); every one of `regions` from start-up, at 0, so that
        increase() sees the first event."""
        family = CounterMetricFamily(name, doc, labels=["model_name", "engine", "region"])
        for rank, s in sorted(stats.items()):
            for region, total in (dict.fromkeys(regions, 0) | dict(totals(s))).items():
                family.add_metric([self.model_name, str(rank), region], float(total))
        return family

    def _labels(self, rank: int) -> list[str]:
        return [self.model_name, str(rank)]

    def _gauge(self, name: str, doc: str, stats: dict[int, StepStats],
               value: Callable[[StepStats], float]) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name", "engine"])
        for rank, s in sorted(stats.items()):
            family.add_metric(self._labels(rank), float(value(s)))
        return family

    def _counter(self, name: str, doc: str, stats: dict[int, StepStats],
                 value: Callable[[StepStats], float]) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["model_name", "engine"])
        for rank, s in sorted(stats.items()):
            family.add_metric(self._labels(rank), float(value(s)))
        return family


class OpImplementationCollector(Collector):
    """kvsentry_op_implementation_info{engine, op, implementation} = 1: what each rank runs."""

    def __init__(self, model_name: str, implementations: OpsSource):
        self.model_name = model_name
        self.implementations = implementations

    def collect(self) -> Iterator[Metric]:
        family = InfoMetricFamily("kvsentry_op_implementation",
                                  "Implementation an op runs on a DP rank (engine/ops/registry.py): a csrc "
                                  "kernel or its fallback (by design, or because the kernel is disabled or "
                                  "failed to build); the GEMM path of each linear kind; CUDA graphs on or off.",
                                  labels=["model_name", "engine", "op"])
        for rank, ops in sorted(dict(self.implementations()).items()):
            for op, implementation in sorted(ops.items()):
                family.add_metric([self.model_name, str(rank), op], {"implementation": implementation})
        yield family


FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class ModelSeries:
    """The per-request series of this server's model, looked up once (labels() is not free
    at one call per streamed token)."""
    prompt_tokens: Counter
    generation_tokens: Counter
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue_time: Histogram
    in_flight: Gauge
    success: dict[str, Counter]


class Metrics:
    def __init__(self, model_name: str, stats: StatsSource, implementations: OpsSource = dict):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r = self.registry
        m = ["model_name"]
        self.http_requests = Counter("kvsentry_http_requests", "HTTP requests by route and status.",
                                     m + ["route", "status"], registry=r)
        self.http_duration = Histogram("kvsentry_http_request_duration_seconds",
                                       "Time to the end of the HTTP response.", m + ["route"],
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvsentry_prompt_tokens", "Prompt tokens of accepted requests.",
                                     m, registry=r)
        self.generation_tokens = Counter("kvsentry_generation_tokens", "Tokens generated.", m, registry=r)
        self.request_success = Counter("kvsentry_request_success", "Finished engine requests by reason.",
                                       m + ["finished_reason"], registry=r)
        self.ttft = Histogram("kvsentry_time_to_first_token_seconds", "Arrival to first generated token.",
                              m, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kvsentry_inter_token_latency_seconds", "Time between tokens of a sample.",
                             m, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("kvsentry_e2e_request_latency_seconds", "Arrival to the last token.",
                             m, buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("kvsentry_request_queue_time_seconds",
                                    "Time a request waited on its DP rank before it was first scheduled.",
                                    m, buckets=_LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("kvsentry_frontend_requests_in_flight",
                               "Engine requests the front end has submitted and not seen finish.",
                               m, registry=r)
        self.rejected = Counter("kvsentry_requests_rejected", "Requests refused before reaching a rank.",
                                m + ["reason"], registry=r)
        self.scan_seconds = Histogram("kvsentry_kv_cache_scan_seconds",
                                      "Duration of one NaN-sentinel scan of a rank's KV cache.",
                                      m + ["engine"], registry=r,
                                      buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0))
        self.checksum_seconds = Histogram("kvsentry_kv_cache_checksum_seconds",
                                          "Time one step spent on KV block checksums of a rank: hashing "
                                          "the blocks that sealed (phase=seal) or the verification "
                                          "sweep (phase=verify).",
                                          m + ["engine", "phase"], registry=r,
                                          buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0))
        r.register(EngineStatsCollector(model_name, stats))
        r.register(OpImplementationCollector(model_name, implementations))
        n = model_name
        self.series = ModelSeries(
            self.prompt_tokens.labels(n), self.generation_tokens.labels(n), self.ttft.labels(n),
            self.itl.labels(n), self.e2e.labels(n), self.queue_time.labels(n), self.in_flight.labels(n),
            {reason: self.request_success.labels(n, reason) for reason in FINISH_REASONS})

    def watch_supervision(self, source) -> None:
        """The rank supervisor's series (service/supervisor_metrics.py), read at scrape time."""
        self.registry.register(SupervisionCollector(self.model_name, source))

    def count_finish(self, reason: str) -> None:
        series = self.series.success.get(reason)
        if series is None:
            series = self.series.success[reason] = self.request_success.labels(self.model_name, reason)
        series.inc()

    def observe_stats(self, stats: StepStats) -> None:
        """Every StepStats as it arrives: each scan, seal or verify duration since the rank's
        last report is one histogram observation."""
        integrity = stats.integrity
        if integrity.scan_seconds:
            series = self.scan_seconds.labels(self.model_name, str(stats.rank))
            for seconds in integrity.scan_seconds:
                series.observe(seconds)
        for phase, durations in (("seal", integrity.seal_seconds), ("verify", integrity.verify_seconds)):
            if durations:
                series = self.checksum_seconds.labels(self.model_name, str(stats.rank), phase)
                for seconds in durations:
                    series.observe(seconds)

    def observe_http(self, route: str, status: int, seconds: float) -> None:
        self.http_requests.labels(self.model_name, route, str(status)).inc()
        self.http_duration.labels(self.model_name, route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
