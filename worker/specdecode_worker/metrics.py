"""Prometheus exposition of the engine's counters, read at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _EngineCollector:
    def __init__(self, state):
        self.state = state

    def collect(self):
        s = self.state.engine
        st = s.stats

        def counter(name, doc, value):
            c = CounterMetricFamily(f"specdecode_{name}", doc)
            c.add_metric([], value)
            return c

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"specdecode_{name}", doc)
            g.add_metric([], value)
            return g

        yield gauge("ready", "1 once phase 3 finished", 1.0 if s.ready else 0.0)
        yield counter("prompt_tokens", "prompt tokens prefilled", st.prompt_tokens)
        yield counter("generation_tokens", "tokens generated", st.generated_tokens)
        yield counter("requests_finished", "requests finished", st.finished_requests)
        yield counter("draft_proposed_tokens", "draft tokens proposed for verification", st.proposed_tokens)
        yield counter("draft_accepted_tokens", "draft tokens the target accepted", st.accepted_tokens)
        yield counter("verify_rounds", "request-rounds verified by the target", st.verify_rounds)
        rate = st.accepted_tokens / st.proposed_tokens if st.proposed_tokens else 0.0
        yield gauge("acceptance_rate", "accepted / proposed draft tokens since start", rate)
        length = (st.accepted_tokens + st.verify_rounds) / st.verify_rounds if st.verify_rounds else 0.0
        yield gauge("accept_length", "mean tokens committed per verify round (accepted + 1)", length)
        phases = GaugeMetricFamily("specdecode_phase_seconds", "duration of each initialisation phase",
                                   labels=["phase"])
        for name, secs in st.phase_seconds.items():
            phases.add_metric([name], secs)
        yield phases
        plan = self.state.plan or {}
        planned = plan.get("kvCache", {}).get("maxTotalNumTokens")
        if planned is not None:
            yield gauge("kv_tokens_planned", "max_total_num_tokens in the memory plan", planned)
        if s.memory_profile is not None:
            yield gauge("kv_tokens_actual", "max_total_num_tokens measured in phase 2",
                        s.memory_profile.max_total_num_tokens)
        if s.ready:
            used, total = s.kv_usage()
            yield gauge("kv_pool_used_tokens", "KV token slots in use", used)
            yield gauge("kv_pool_capacity_tokens", "KV token slots in the pool", total)
            yield gauge("kv_pool_usage_ratio", "share of KV token slots in use", used / total if total else 0.0)
            yield gauge("running_requests", "requests being decoded", s.num_running)
            yield gauge("waiting_requests", "requests queued for KV slots", s.num_waiting)


def render(state) -> bytes:
    registry = CollectorRegistry()
    registry.register(_EngineCollector(state))
    return generate_latest(registry)
