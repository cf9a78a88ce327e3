"""Prometheus exposition of the engine's counters, read at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _EngineCollector:
    def __init__(self, state):
        self.state = state

    def collect(self):
        engine = self.state.engine
        stats = engine.stats

        def counter(name, doc, value):
            c = CounterMetricFamily(f"specdecode_{name}", doc)
            c.add_metric([], value)
            return c

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"specdecode_{name}", doc)
            g.add_metric([], value)
            return g

        yield gauge("ready", "1 once phase 3 finished", 1.0 if engine.ready else 0.0)
        yield counter("prompt_tokens", "prompt tokens prefilled", stats.prompt_tokens)
        yield counter("generation_tokens", "tokens generated", stats.generated_tokens)
        yield counter("requests_finished", "requests finished", stats.finished_requests)
        yield counter("draft_proposed_tokens", "draft tokens proposed for verification", stats.proposed_tokens)
        yield counter("draft_accepted_tokens", "draft tokens the target accepted", stats.accepted_tokens)
        yield counter("verify_rounds", "request-rounds verified by the target", stats.verify_rounds)
        rate = stats.accepted_tokens / stats.proposed_tokens if stats.proposed_tokens else 0.0
        yield gauge("acceptance_rate", "accepted / proposed draft tokens since start", rate)
        length = (stats.accepted_tokens + stats.verify_rounds) / stats.verify_rounds if stats.verify_rounds else 0.0
        yield gauge("accept_length", "mean tokens committed per verify round (accepted + 1)", length)
        phases = GaugeMetricFamily("specdecode_phase_seconds", "duration of each initialisation phase",
                                   labels=["phase"])
        for name, secs in stats.phase_seconds.items():
            phases.add_metric([name], secs)
        yield phases
        plan = self.state.plan or {}
        planned = plan.get("kvCache", {}).get("maxTotalNumTokens")
        if planned is not None:
            yield gauge("kv_tokens_planned", "max_total_num_tokens in the memory plan", planned)
        if engine.memory_profile is not None:
            yield gauge("kv_tokens_actual", "max_total_num_tokens measured in phase 2",
                        engine.memory_profile.max_total_num_tokens)
        if engine.ready:
            used, total = engine.kv_usage()
            yield gauge("kv_pool_used_tokens", "KV token slots in use", used)
            yield gauge("kv_pool_capacity_tokens", "KV token slots in the pool", total)
            yield gauge("kv_pool_usage_ratio", "share of KV token slots in use", used / total if total else 0.0)
            yield gauge("running_requests", "requests being decoded", engine.num_running)
            yield gauge("waiting_requests", "requests queued for KV slots", engine.num_waiting)


def render(state) -> bytes:
    registry = CollectorRegistry()
    registry.register(_EngineCollector(state))
    return generate_latest(registry)
