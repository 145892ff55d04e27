"""vLLM's periodic engine line: every 10 s while there is work (and once
after it ends), the prompt and generation throughput since the last line,
the running and waiting requests, KV cache usage and the prefix cache's hit
rate, so that `journalctl -u tqserve` shows the load (--disable-log-stats:
off). Read from the engine's counters, as /metrics is."""
import asyncio
import logging
import time

log = logging.getLogger("tqserve.stats")

INTERVAL_S = 10.0


class StatsLogger:
    def __init__(self, state, interval_s: float = INTERVAL_S):
        self.state = state
        self.interval_s = interval_s
        self.last = self._read()
        self.t = time.monotonic()

    def _read(self) -> dict:
        return dict(self.state.llm.stats())

    def line(self) -> str | None:
        """The line for the interval that ends now, or None when it and the one before were idle."""
        now, cur = time.monotonic(), self._read()
        dt = max(now - self.t, 1e-9)
        prev, self.last, self.t = self.last, cur, now

        def delta(key):
            return cur.get(key, 0) - prev.get(key, 0)
        prompt, gen = delta("prompt_tokens_total"), delta("generation_tokens_total")
        busy = cur.get("num_running", 0) or cur.get("num_waiting", 0)
        if not (prompt or gen or busy or prev.get("num_running", 0) or prev.get("num_waiting", 0)):
            return None
        queries, hits = delta("prefix_cache_queries_total"), delta("prefix_cache_hits_total")
        return (f"Avg prompt throughput: {prompt / dt:.1f} tokens/s, Avg generation throughput: {gen / dt:.1f} "
                f"tokens/s, Running: {cur.get('num_running', 0)} reqs, Waiting: {cur.get('num_waiting', 0)} reqs, "
                f"KV cache usage: {100 * cur.get('kv_cache_usage', 0.0):.1f}%, "
                f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%")

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            text = self.line()
            if text is not None:
                log.info("%s", text)
