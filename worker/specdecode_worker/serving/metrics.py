"""Prometheus exposition of the engine's counters, read at scrape time, and request latency
histograms recorded as tokens reach the HTTP layer."""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class RequestLatency:
    """Time to first token, inter-token latency and end-to-end latency of the requests served.

    Measured where the tokens reach the HTTP layer (the engine's ``on_update`` callback), from the
    moment the request was submitted. A verify round commits several tokens at once; each of them
    counts the round's gap divided by how many it committed, so the histogram's mean is the mean
    time per generated token the client sees.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.ttft = Histogram("specdecode_time_to_first_token_seconds", "seconds from submission to the first token",
                              buckets=TTFT_BUCKETS, registry=None)
        self.inter_token = Histogram("specdecode_inter_token_latency_seconds",
                                     "seconds between generated tokens after the first", buckets=INTER_TOKEN_BUCKETS,
                                     registry=None)
        self.e2e = Histogram("specdecode_e2e_request_latency_seconds",
                             "seconds from submission to the end of a request that finished without error",
                             buckets=E2E_BUCKETS, registry=None)

    def timed(self, on_update: Callable) -> Callable:
        """``on_update`` wrapped to observe one request's latencies; wrap at submission."""
        start = self.clock()
        last: list[float] = []

        def update(req, tokens):
            now = self.clock()
            if tokens is None:
                if req.error is None and last:
                    self.e2e.observe(now - start)
            elif tokens:
                if not last:
                    self.ttft.observe(now - start)
                    last.append(now)
                else:
                    gap = (now - last[0]) / len(tokens)
                    for _ in tokens:
                        self.inter_token.observe(gap)
                    last[0] = now
            on_update(req, tokens)

        return update

    def collectors(self):
        return self.ttft, self.inter_token, self.e2e


class _EngineCollector:
    def __init__(self, state):
        self.state = state

    def collect(self):
        report = self.state.engine.report()
        stats = report.stats

        def counter(name, doc, value):
            c = CounterMetricFamily(f"specdecode_{name}", doc)
            c.add_metric([], value)
            return c

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"specdecode_{name}", doc)
            g.add_metric([], value)
            return g

        yield gauge("ready", "1 once phase 3 finished", 1.0 if report.ready else 0.0)
        yield counter("prompt_tokens", "prompt tokens of requests (those the prefix cache served included)",
                      stats.prompt_tokens)
        yield counter("prompt_cached_tokens", "prompt tokens the prefix cache served (not prefilled)",
                      stats.cached_prompt_tokens)
        hit = stats.cached_prompt_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
        yield gauge("prefix_cache_hit_rate", "prompt tokens the prefix cache served / prompt tokens, since start", hit)
        yield counter("generation_tokens", "tokens generated", stats.generated_tokens)
        yield counter("requests_finished", "requests finished", stats.finished_requests)
        yield counter("draft_proposed_tokens", "draft tokens proposed for verification", stats.proposed_tokens)
        yield counter("draft_accepted_tokens", "draft tokens the target accepted", stats.accepted_tokens)
        yield counter("verify_rounds", "request-rounds verified by the target", stats.verify_rounds)
        yield counter("retractions", "requests retracted under KV pressure (their work recomputed later)",
                      stats.retracted_requests)
        rate = stats.accepted_tokens / stats.proposed_tokens if stats.proposed_tokens else 0.0
        yield gauge("acceptance_rate", "accepted / proposed draft tokens since start", rate)
        length = (stats.accepted_tokens + stats.verify_rounds) / stats.verify_rounds if stats.verify_rounds else 0.0
        yield gauge("accept_length", "mean tokens committed per verify round (accepted + 1)", length)
        yield from speculation_policy_metrics(stats, report.policy, counter, gauge)
        phases = GaugeMetricFamily("specdecode_phase_seconds", "duration of each initialisation phase",
                                   labels=["phase"])
        for name, secs in stats.phase_seconds.items():
            phases.add_metric([name], secs)
        yield phases
        plan = self.state.plan
        if plan is not None:
            yield gauge("kv_tokens_planned", "max_total_num_tokens in the memory plan",
                        plan.kv_cache.max_total_num_tokens)
        if report.kv_tokens_actual is not None:
            yield gauge("kv_tokens_actual", "max_total_num_tokens measured in phase 2", report.kv_tokens_actual)
        if plan is not None:
            yield gauge("dynamic_bytes_planned", "R_dynamic in the memory plan: bytes left free for activations, "
                        "logits and CUDA graphs", plan.reserve.dynamic_bytes)
        warm = report.dynamic
        if warm.get("measured") is not None:
            yield gauge("dynamic_bytes_measured", "dynamic peak measured by phase 3's warm-up (largest prefill "
                        "chunk, largest graph batch): allocator peak beyond weights and pools (CUDA only)",
                        warm["measured"])
        if warm.get("reserved") is not None:
            yield gauge("dynamic_bytes_reserved", "the caching allocator's reserved peak over phase 3's warm-up "
                        "beyond weights and pools: its slack and the CUDA graph pools included (CUDA only)",
                        warm["reserved"])
        if warm.get("driver") is not None:
            yield gauge("dynamic_bytes_driver", "device memory in use after phase 3's warm-up as the driver counts "
                        "it, beyond weights, pools and the runtime reserve (CUDA only)", warm["driver"])
        if report.allocator_peak_bytes is not None:
            yield gauge("dynamic_bytes_peak", "peak bytes the torch allocator held beyond weights and KV pools "
                        "since start (CUDA only)", report.allocator_peak_bytes)
        if report.kv is not None:
            used, total = report.kv.used, report.kv.capacity
            yield gauge("kv_pool_used_tokens", "KV token slots running requests hold", used)
            cache = report.prefix_cache
            if cache is not None:
                yield gauge("prefix_cache_tokens", "KV token slots the prefix cache holds", cache["cachedTokens"])
                yield gauge("prefix_cache_evictable_tokens", "of them, slots no running request holds (free capacity)",
                            cache["evictableTokens"])
                yield counter("prefix_cache_evicted_tokens", "cached KV token slots evicted under pressure",
                              cache["evictedTokens"])
            yield gauge("kv_pool_capacity_tokens", "KV token slots in the pool", total)
            yield gauge("kv_pool_usage_ratio", "share of KV token slots in use", used / total if total else 0.0)
            yield gauge("running_requests", "requests being decoded", report.running)
            yield gauge("waiting_requests", "requests queued for KV slots", report.waiting)


def speculation_policy_metrics(stats, policy, counter, gauge):
    """What the speculation policy chose and what it earned: draft lengths, rounds without
    drafting, probe rounds, drafting's measured speed-up by batch size, acceptance by draft
    position and goodput (tokens per second of decode rounds)."""
    lengths = stats.draft_lengths
    buckets, seen = [], 0
    for k in range(max(lengths, default=0) + 1):
        seen += lengths.get(k, 0)
        buckets.append((str(k), seen))
    buckets.append(("+Inf", seen))
    yield HistogramMetricFamily("specdecode_draft_length", "draft tokens chosen per request and decode round",
                                buckets=buckets, sum_value=sum(k * n for k, n in lengths.items()))
    yield counter("decode_steps", "decode rounds run for the whole batch", stats.decode_steps)
    yield counter("steps_without_speculation", "decode rounds in which no request drafted",
                  stats.steps_without_speculation)
    share = stats.steps_without_speculation / stats.decode_steps if stats.decode_steps else 0.0
    yield gauge("steps_without_speculation_ratio", "share of decode rounds in which no request drafted", share)
    if policy is not None:
        yield counter("policy_probe_rounds", "decode rounds the adaptive policy ran to measure (a plain round while "
                      "drafting, a drafting round while not), not because they were expected to be faster",
                      policy["probeRounds"])
        speedup = GaugeMetricFamily("specdecode_policy_measured_speedup",
                                    "recent drafting rounds' speed over plain rounds', as the adaptive policy "
                                    "measured them, by batch-size bucket (below 1: drafting is off there)",
                                    labels=["batch"])
        for bucket, ratio in policy["measuredSpeedup"].items():
            speedup.add_metric([bucket], ratio)
        yield speedup
    by_position = GaugeMetricFamily("specdecode_acceptance_by_position",
                                    "accepted / verified draft tokens at each draft position (1 = first)",
                                    labels=["position"])
    for position, verified in sorted(stats.proposed_by_position.items()):
        by_position.add_metric([str(position)], stats.accepted_by_position.get(position, 0) / verified)
    yield by_position
    yield counter("decode_seconds", "seconds spent in decode rounds", stats.decode_seconds)
    yield counter("decode_tokens", "tokens committed by decode rounds", stats.decode_tokens)
    goodput = stats.decode_tokens / stats.decode_seconds if stats.decode_seconds else 0.0
    yield gauge("goodput_tokens_per_second", "tokens committed per second of decode rounds since start", goodput)


def render(state) -> bytes:
    registry = CollectorRegistry()
    registry.register(_EngineCollector(state))
    latency = getattr(state, "latency", None)
    for histogram in latency.collectors() if latency else ():
        registry.register(histogram)
    return generate_latest(registry)
