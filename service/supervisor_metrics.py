"""The rank supervisor's series, read from its counters at scrape time
(engine/dp/supervision.py): restarts by rank and reason, re-queued and failed requests, live ranks."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.dp.supervision import RESTART_REASONS, SupervisionCounters

SupervisionSource = Callable[[], SupervisionCounters | None]


class SupervisionCollector(Collector):
    def __init__(self, model_name: str, source: SupervisionSource):
        self.model_name = model_name
        self.source = source

    def collect(self) -> Iterator[Metric]:
        counters = self.source()
        if counters is None:  # an engine client without a supervisor
            return
        restarts = CounterMetricFamily("kvsentry_rank_restarts", "DP rank processes respawned by the supervisor, "
                                       "by rank and why the old one ended (killed, exited, wedged).",
                                       labels=["model_name", "engine", "reason"])
        # Every (rank, reason) from 0: a series born at 1 would hide its first restart from increase().
        keys = {(rank, reason) for rank in counters.ranks for reason in RESTART_REASONS} | set(counters.restarts)
        for rank, reason in sorted(keys):
            restarts.add_metric([self.model_name, str(rank), reason], counters.restarts[(rank, reason)])
        yield restarts
        yield self._counter("kvsentry_requests_requeued",
                            "Requests whose rank died before they produced output, moved to a live rank.",
                            counters.requeued)
        yield self._counter("kvsentry_requests_failed_by_rank_death",
                            "Requests ended with an error because their rank died after they had produced output.",
                            counters.failed_by_rank_death)
        live = GaugeMetricFamily("kvsentry_live_ranks", "DP ranks taking requests now.", labels=["model_name"])
        live.add_metric([self.model_name], counters.live_ranks)
        yield live

    def _counter(self, name: str, doc: str, value: int) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family
