"""Prometheus metrics under the `tqserve:` prefix, named as vLLM names them
(and vLLM's HTTP ones, http_requests_total and http_request_duration_seconds).

Per-request counters and histograms are fed by the server as requests finish;
engine-wide gauges and counters (running/waiting, KV usage, preemptions,
prefix cache) are read from `AsyncLLM.stats()` at scrape time. Every series
carries a `model_name` label, as in vLLM. The registry is our own (not the
process-global default one), so several apps can live in one process.
"""
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "tqserve:"

disable_created_metrics()     # no *_created series (as vLLM): they double the scrape for nothing

# Buckets as vLLM uses them.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def _token_buckets(max_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_len (vLLM's build_1_2_5_buckets)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exp
            if v > max_len:
                return out
            out.append(v)
        exp += 1


class Metrics:
    def __init__(self, model_name: str, max_model_len: int = 8192,
                 stats: Callable[[], dict] | None = None, kv_info: Callable[[], dict | None] | None = None,
                 cache_config: Callable[[], dict] | None = None, sleep_level: Callable[[], int] | None = None):
        """cache_config: vLLM's cache_config_info labels; sleep_level: 0 awake, else the sleep level."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self._stats = stats or (lambda: {})
        self._kv_info = kv_info or (lambda: None)
        self._cache_config = cache_config or (lambda: {})
        self._sleep_level = sleep_level or (lambda: 0)
        r, L = self.registry, ["model_name"]
        self.prompt_tokens = Counter(P + "prompt_tokens", "Number of prefill tokens processed.", L, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Number of generation tokens processed.",
                                         L, registry=r)
        self.request_success = Counter(P + "request_success", "Count of successfully processed requests.",
                                       L + ["finished_reason"], registry=r)
        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(P + name, doc, L, buckets=buckets, registry=r)
        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        LATENCY_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                               LATENCY_BUCKETS)
        # A request's phases from its timestamps (vLLM's names): prefill = scheduled -> first
        # token, decode = first -> last token, inference = scheduled -> last token.
        self.prefill_time = hist("request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", LATENCY_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", LATENCY_BUCKETS)
        self.inference_time = hist("request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", LATENCY_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.params_n = hist("request_params_n", "Histogram of the n request parameter.", (1, 2, 5, 10, 20))
        tb = _token_buckets(max(max_model_len, 1))
        self.params_max_tokens = hist("request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                      tb)
        self.req_prompt_tokens = hist("request_prompt_tokens", "Number of prefill tokens processed.", tb)
        self.req_gen_tokens = hist("request_generation_tokens", "Number of generation tokens processed.", tb)
        self.req_max_gen_tokens = hist("request_max_num_generation_tokens",
                                       "Histogram of maximum number of requested generation tokens.", tb)
        # HTTP level, as vLLM's server exposes them (prometheus-fastapi-instrumentator's names
        # and labels: no prefix, the route's template as handler, status grouped as "2xx").
        self.http_requests = Counter("http_requests", "Total number of requests by method, status and handler.",
                                     ["handler", "method", "status"], registry=r)
        self.http_duration = Histogram("http_request_duration_seconds",
                                       "Latency with only few buckets by handler and method.",
                                       ["handler", "method"], buckets=(0.1, 0.5, 1.0), registry=r)
        r.register(_EngineCollector(self))
        # Children, so the label lookup is done once.
        m = model_name
        self._prompt_tokens = self.prompt_tokens.labels(m)
        self._generation_tokens = self.generation_tokens.labels(m)
        self._ttft = self.ttft.labels(m)
        self._itl = self.itl.labels(m)
        self._e2e = self.e2e.labels(m)
        self._queue = self.queue_time.labels(m)
        self._req_prompt = self.req_prompt_tokens.labels(m)
        self._req_gen = self.req_gen_tokens.labels(m)
        self._req_max_gen = self.req_max_gen_tokens.labels(m)
        self._phases = (self.prefill_time.labels(m), self.decode_time.labels(m), self.inference_time.labels(m),
                        self.tpot.labels(m))
        self._params_n, self._params_max_tokens = self.params_n.labels(m), self.params_max_tokens.labels(m)
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(m, reason)

    # --- fed by the server -------------------------------------------------
    def observe_itl(self, seconds: float, count: int = 1) -> None:
        for _ in range(count):
            self._itl.observe(seconds)

    def observe_phases(self, *, scheduled: float, first_token: float, last_token: float, tokens: int) -> None:
        """One request's timestamps (monotonic seconds) and output tokens (one sequence's)."""
        prefill, decode, inference, tpot = self._phases
        prefill.observe(first_token - scheduled)
        decode.observe(last_token - first_token)
        inference.observe(last_token - scheduled)
        if tokens > 1:
            tpot.observe((last_token - first_token) / (tokens - 1))

    def observe_params(self, *, n: int, max_tokens: int | None) -> None:
        self._params_n.observe(n)
        if max_tokens is not None:
            self._params_max_tokens.observe(max_tokens)

    def observe_finished(self, *, prompt_tokens: int, generation_tokens: int,
                         finish_reasons: list[str], ttft: float | None, e2e: float,
                         queue_time: float | None, max_generation_tokens: int | None = None) -> None:
        """max_generation_tokens: the longest of the request's n sequences (default: all its tokens)."""
        self._prompt_tokens.inc(prompt_tokens)
        self._generation_tokens.inc(generation_tokens)
        for reason in finish_reasons:
            self.request_success.labels(self.model_name, reason or "abort").inc()
        if ttft is not None:
            self._ttft.observe(ttft)
        self._e2e.observe(e2e)
        if queue_time is not None:
            self._queue.observe(queue_time)
        self._req_prompt.observe(prompt_tokens)
        self._req_gen.observe(generation_tokens)
        self._req_max_gen.observe(generation_tokens if max_generation_tokens is None else max_generation_tokens)

    def observe_http(self, handler: str, method: str, status: int, seconds: float) -> None:
        self.http_requests.labels(handler, method, f"{status // 100}xx").inc()
        self.http_duration.labels(handler, method).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Engine-wide values, read from the engine at scrape time."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        s = self.m._stats() or {}
        name = self.m.model_name

        def gauge(metric, doc, value):
            g = GaugeMetricFamily(P + metric, doc, labels=["model_name"])
            g.add_metric([name], float(value))
            return g

        def counter(metric, doc, value):
            c = CounterMetricFamily(P + metric, doc, labels=["model_name"])
            c.add_metric([name], float(value))
            return c

        yield gauge("num_requests_running", "Number of requests in model execution batches.",
                    s.get("num_running", 0))
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.",
                    s.get("num_waiting", 0))
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    s.get("kv_cache_usage", 0.0))
        yield counter("num_preemptions", "Cumulative number of preemptions from the engine.",
                      s.get("num_preemptions_total", 0))
        yield counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      s.get("prefix_cache_queries_total", 0))
        yield counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      s.get("prefix_cache_hits_total", 0))
        if s.get("spec_decode_num_accepted_tokens_per_pos"):
            for metric, doc in (("spec_decode_num_drafts", "Number of spec decoding drafts."),
                                ("spec_decode_num_draft_tokens", "Number of draft tokens."),
                                ("spec_decode_num_accepted_tokens", "Number of accepted tokens.")):
                yield counter(metric, doc, s.get(metric + "_total", 0))
            c = CounterMetricFamily(P + "spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted tokens per draft position.", labels=["model_name", "position"])
            for pos, n in enumerate(s["spec_decode_num_accepted_tokens_per_pos"]):
                c.add_metric([name, str(pos)], float(n))
            yield c
        if s.get("max_lora") is not None:
            # vLLM's: the adapters of the running and waiting requests, as labels (comma-separated).
            g = GaugeMetricFamily(P + "lora_requests_info", "Running stats on lora requests.",
                                  labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            g.add_metric([str(s["max_lora"]), ",".join(s.get("running_lora_adapters", [])),
                          ",".join(s.get("waiting_lora_adapters", []))], time.time())
            yield g
        # vLLM's: 1 on the engine's state (sleep mode), 0 on the others.
        g = GaugeMetricFamily(P + "engine_sleep_state", "Engine sleep state; awake = 0 means engine is sleeping; "
                              "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
                              labels=["engine", "sleep_state"])
        level = self.m._sleep_level()
        for i, state in enumerate(("awake", "weights_offloaded", "discard_all")):
            g.add_metric(["0", state], float(level == i))
        yield g
        config = self.m._cache_config()
        if config:
            g = GaugeMetricFamily(P + "cache_config_info", "Information of the LLMEngine CacheConfig",
                                  labels=sorted(config))
            g.add_metric([str(config[k]) for k in sorted(config)], 1.0)
            yield g
        info = self.m._kv_info() or {}
        if info:
            yield gauge("kv_cache_capacity_tokens", "Number of tokens the KV cache pool holds.",
                        info.get("capacity_tokens", 0))
            g = GaugeMetricFamily(P + "kv_cache_bytes_per_token",
                                  "KV cache bytes per token, all layers (kind=all) and per layer kind.",
                                  labels=["model_name", "kind"])
            g.add_metric([name, "all"], float(info.get("bytes_per_token", 0)))
            for kind, b in (info.get("bytes_per_token_by_kind") or {}).items():
                g.add_metric([name, str(kind)], float(b))
            yield g
            if info.get("hot_bytes_per_seq"):
                yield gauge("kv_cache_hot_bytes_per_sequence",
                            "Bytes of TurboQuant hot tokens (int8 first and newest block) per running sequence.",
                            info["hot_bytes_per_seq"])
            if info.get("compression_ratio") is not None:
                yield gauge("kv_cache_compression_ratio",
                            "Uncompressed (16-bit) KV bytes per token over stored bytes per token.",
                            info["compression_ratio"])
