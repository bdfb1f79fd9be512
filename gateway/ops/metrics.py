"""Prometheus metrics (SPEC §8). One registry per gateway, so tests stay independent."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client import Counter as _Counter
from prometheus_client import Gauge as _Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from gateway.store.rows import StoreStats

if TYPE_CHECKING:
    from gateway.model.client import CallRecord


@dataclass(slots=True)
class ModelCalls:
    """What one model's calls did since the start: the admin page's model state."""

    calls: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # by error kind (rate_limit, timeout, …)
    last_ok_at: float | None = None
    last_error: dict[str, Any] | None = None  # at, kind, status, detail


class ModelHealth:
    """Each model's calls (HTTP attempts) by outcome, its last success and its last error,
    by model name. Names come from the config, so the table stays small."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.models: dict[str, ModelCalls] = {}

    def record(self, model: str, outcome: str, status: int | None = None, detail: str | None = None) -> None:
        state = self.models.setdefault(model, ModelCalls())
        state.calls += 1
        if outcome == "ok":
            state.last_ok_at = self.clock()
            return
        state.failures[outcome] = state.failures.get(outcome, 0) + 1
        state.last_error = {"at": self.clock(), "kind": outcome, "status": status, "detail": detail}

    def get(self, model: str) -> ModelCalls:
        return self.models.get(model) or ModelCalls()


class _KnownChildren:
    """`.labels(...)` answered from a plain dict after the first call with those values.
    The library's own lookup takes a lock and rebuilds the key every time; turns call it a
    few times each, and the label values (channels, outcomes) are a handful."""

    def labels(self, *values: Any, **named: Any) -> Any:
        if named:
            return super().labels(*values, **named)  # type: ignore[misc]
        children: dict[tuple[Any, ...], Any] | None = self.__dict__.get("_known")
        if children is None:
            children = self.__dict__["_known"] = {}
        child = children.get(values)
        if child is None:
            child = children[values] = super().labels(*values)  # type: ignore[misc]
        return child

    def remove(self, *values: Any) -> None:
        self.__dict__.pop("_known", None)
        super().remove(*values)  # type: ignore[misc]

    def clear(self) -> None:
        self.__dict__.pop("_known", None)
        super().clear()  # type: ignore[misc]


class Counter(_KnownChildren, _Counter):
    pass


class Gauge(_KnownChildren, _Gauge):
    pass


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.inbound = Counter("gateway_inbound_messages_total", "Inbound messages", ["channel"], registry=r)
        self.turns = Counter("gateway_turns_total", "Turns finished", ["channel", "outcome"], registry=r)
        self.model_calls = Counter("gateway_model_calls_total", "Model HTTP attempts", ["outcome"], registry=r)
        self.model_fallbacks = Counter(
            "gateway_model_fallbacks_total", "Model calls handed to a fallback after the model failed (SPEC §5.5)",
            ["from", "to"], registry=r,
        )
        self.model_latency = Histogram(
            "gateway_model_latency_seconds", "Model call latency", registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
        )
        self.tokens = Counter("gateway_tokens_total", "Tokens reported by the provider", ["direction"], registry=r)
        self.trims = Counter("gateway_context_trims_total", "Context rules fired", ["strategy"], registry=r)
        self.compactions = Counter("gateway_compactions_total", "Summaries written", ["reason"], registry=r)
        self.summary_failures = Counter("gateway_summary_failures_total", "Summaries that fell back", registry=r)
        self.overflow_recoveries = Counter(
            "gateway_overflow_recoveries_total", "Overflow recoveries", ["result"], registry=r
        )
        self.dedup_hits = Counter("gateway_dedup_hits_total", "Redelivered events dropped", ["channel"], registry=r)
        self.queue_depth = Gauge("gateway_queue_depth", "Turns waiting in session queues", registry=r)
        self.live_sessions = Gauge("gateway_live_sessions", "Sessions held in memory", registry=r)
        self.refused = Counter("gateway_refused_total", "Messages refused by access rules", ["channel", "reason"],
                               registry=r)
        self.busy = Counter("gateway_busy_replies_total", "Busy replies (queue full)", registry=r)
        self.job_runs = Counter("gateway_job_runs_total", "Scheduled job runs", ["job", "outcome"], registry=r)
        self.task_runs = Counter("gateway_task_runs_total", "Runs of tasks people scheduled (queued as a turn, "
                                 "busy, refused, missed …)", ["outcome"], registry=r)
        self.tool_calls = Counter("gateway_tool_calls_total", "Tool calls", ["tool", "outcome"], registry=r)
        self.stream_events = Counter(
            "gateway_stream_events_total", "What streamed replies did (channels/base.py StreamObserver)",
            ["channel", "event"], registry=r,
        )
        self.mcp_server_up = Gauge("gateway_mcp_server_up", "MCP server connected (1) or not (0)", ["server"],
                                   registry=r)
        self.leader = Gauge("gateway_leader", "This gateway receives for the role (1) or another gateway of "
                            "the cluster does (0): Telegram polling, Slack Socket Mode", ["role"], registry=r)
        self.mcp_restarts = Counter("gateway_mcp_restarts_total", "MCP server connections lost or failed "
                                    "(each is retried with backoff)", ["server"], registry=r)

        self.leases_held = Gauge("gateway_leases_held", "Leases this gateway holds on the shared database "
                                 "(sessions running here, polling, its own liveness)", registry=r)
        self.auth_failures = Counter("gateway_auth_failures_total", "Requests with a wrong bearer token, by API "
                                     "(web chat, admin); each address's are answered ever more slowly",
                                     ["api"], registry=r)
        self.hook_requests = Counter("gateway_hook_requests_total", "Requests to /hooks/<name> (SPEC §5.9), "
                                     "by outcome", ["outcome"], registry=r)
        self.takeovers = Counter("gateway_turns_taken_over_total", "Turns another gateway accepted or began "
                                 "and this one ran after that gateway died or stalled", registry=r)
        self.model_health = ModelHealth()  # the admin page's model state (not exported)

    def fallbacks_used(self) -> list[tuple[str, str, int]]:
        """(model, fallback, times) of gateway_model_fallbacks_total, the most used first."""
        used = [(sample.labels["from"], sample.labels["to"], int(sample.value))
                for metric in self.model_fallbacks.collect() for sample in metric.samples
                if sample.name.endswith("_total") and sample.value > 0]
        return sorted(used, key=lambda row: (-row[2], row[0], row[1]))

    def model_call(self, record: CallRecord) -> None:
        """One model HTTP attempt (ModelClient's `on_call`): counted, timed, and kept for the
        admin page's model state."""
        self.model_calls.labels(record.outcome).inc()
        self.model_health.record(record.model, record.outcome, record.status, record.detail)
        self.model_latency.observe(record.seconds)

    def stream_observer(self, channel: str) -> Callable[[str], None]:
        """A channel's StreamObserver: counts each event it reports, by name."""
        def observe(event: str) -> None:
            self.stream_events.labels(channel, event).inc()
        return observe

    def watch_store(self, stats: Callable[[], StoreStats]) -> None:
        """The store's write counters, read at each scrape."""
        self.registry.register(_StoreCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def exposition(self) -> tuple[bytes, str]:
        """/metrics: the rendered registry and its content type."""
        return self.render(), self.content_type

    def job_run(self, job: str, outcome: str) -> None:
        self.job_runs.labels(job, outcome).inc()


class _StoreCollector(Collector):
    def __init__(self, stats: Callable[[], StoreStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        st = self._stats()
        rows = CounterMetricFamily("gateway_db_rows_written", "Rows written by group commit", labels=["table"])
        commits = CounterMetricFamily("gateway_db_commits", "Group commits (one multi-row insert each)",
                                      labels=["table"])
        for table, n in st.rows.items():
            rows.add_metric([table], n)
            commits.add_metric([table], st.commits.get(table, 0))
        yield rows
        yield commits
        yield CounterMetricFamily("gateway_db_wal_checkpoints", "Background WAL checkpoints",
                                  value=st.checkpoints)
        yield GaugeMetricFamily("gateway_db_wal_frames", "Pages in the WAL at the last checkpoint",
                                value=st.wal_frames)
        yield CounterMetricFamily("gateway_db_wal_restarts", "WAL restarts after it passed its size limit",
                                  value=st.wal_restarts)
