"""Prometheus metrics of the server, named as vLLM names them with the ``pagedflash:`` prefix.

Defined once here, in a registry of the server's own (two servers in one process do not collide);
recorded by the engine loop thread after each step (:class:`EngineMetrics` methods), exported by
``GET /metrics``. Latencies are measured by the loop thread, from the request's arrival at the
server to the step that produced its tokens.

==========================================  =========  ==============================================
name (as exported)                          type       meaning
==========================================  =========  ==============================================
pagedflash:num_requests_running             gauge      requests holding KV pages (prefill or decode)
pagedflash:num_requests_waiting             gauge      requests queued for admission
pagedflash:kv_cache_usage_perc              gauge      fraction of KV pages in use (0..1)
pagedflash:prefix_cache_queries_total       counter    prompt tokens looked up in the prefix cache
pagedflash:prefix_cache_hits_total          counter    of those, tokens found there
pagedflash:prompt_tokens_total              counter    prompt tokens of accepted requests
pagedflash:generation_tokens_total          counter    tokens generated
pagedflash:request_success_total            counter    finished requests, label ``finished_reason``:
                                                       stop, length, abort (client gone), error (a
                                                       step failed)
pagedflash:num_preemptions_total            counter    requests preempted (recomputed later)
pagedflash:time_to_first_token_seconds      histogram  arrival to first token
pagedflash:inter_token_latency_seconds      histogram  between consecutive tokens of a request
pagedflash:e2e_request_latency_seconds      histogram  arrival to last token
==========================================  =========  ==============================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "pagedflash:"
FINISHED_REASONS = ("stop", "length", "abort", "error")
# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class EngineMetrics:
    """The server's metrics, each labelled with ``model_name`` (vLLM's label)."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        kw = dict(labelnames=("model_name",), registry=self.registry)

        def one(cls, name, doc, **extra):
            return cls(PREFIX + name, doc, **kw, **extra).labels(model_name=model_name)

        self.running = one(Gauge, "num_requests_running", "Requests holding KV pages (prefill or decode).")
        self.waiting = one(Gauge, "num_requests_waiting", "Requests queued for admission.")
        self.kv_usage = one(Gauge, "kv_cache_usage_perc", "Fraction of KV-cache pages in use (1 = full).")
        self.prefix_queries = one(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = one(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = one(Counter, "prompt_tokens", "Prompt tokens of accepted requests.")
        self.generation_tokens = one(Counter, "generation_tokens", "Generated tokens.")
        self.preemptions = one(Counter, "num_preemptions", "Requests preempted (their KV recomputed later).")
        self.ttft = one(Histogram, "time_to_first_token_seconds", "Arrival to first token.", buckets=TTFT_BUCKETS)
        self.itl = one(Histogram, "inter_token_latency_seconds", "Between consecutive tokens of a request.",
                       buckets=ITL_BUCKETS)
        self.e2e = one(Histogram, "e2e_request_latency_seconds", "Arrival to last token.", buckets=E2E_BUCKETS)
        success = Counter(PREFIX + "request_success", "Finished requests by reason.",
                          labelnames=("model_name", "finished_reason"), registry=self.registry)
        self.finished = {r: success.labels(model_name=model_name, finished_reason=r) for r in FINISHED_REASONS}

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
