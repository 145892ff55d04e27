"""SIGTERM drains with the listener up, on the real server: /health answers 503
(draining, in OpenAI's error shape) instead of refusing connections, new
generation requests get 503, in-flight streams finish (or are aborted at
--drain-timeout with finish_reason "abort" and [DONE]); then the port closes and
the process exits 0. A second signal during the drain stops at once."""
import json
import signal
import threading
import time

import httpx
import pytest
from test_server_process import SMALL, ServerProcess

MODEL = "smollm2-135m"
N_STREAMS = 8
# Long enough to be still generating while the test probes the draining server
# (that takes well under a second); short enough to finish in bounded time on a
# shared, busy 2-core CPU: 8 streams of 96 tokens take seconds when it is idle,
# about two minutes when other jobs load it 5x over.
TOKENS = 96


class Streams:
    """N streaming chat completions in threads; records each one's chunks, [DONE]
    and any transport error."""

    def __init__(self, url: str, n: int, max_tokens: int):
        self.url, self.max_tokens = url, max_tokens
        self.chunks = [[] for _ in range(n)]
        self.done = [False] * n
        self.errors = [None] * n
        self.ended_at = [None] * n
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Tell a long story, number {i}."}],
                "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body,
                              timeout=httpx.Timeout(120, connect=10)) as r:
                if r.status_code != 200:
                    r.read()
                    self.errors[i] = f"HTTP {r.status_code}: {r.text}"
                    return
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done[i] = True
                    elif line.startswith("data: "):
                        self.chunks[i].append(json.loads(line[6:]))
        except httpx.HTTPError as e:
            self.errors[i] = repr(e)
        finally:
            self.ended_at[i] = time.monotonic()

    def all_started(self) -> bool:
        # A content delta means the request is past prefill and generating.
        return all(any(c["choices"] and c["choices"][0]["delta"].get("content") for c in ch)
                   for ch in self.chunks)

    def running(self) -> int:
        return sum(t.is_alive() for t in self.threads)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def finish_reason(self, i: int):
        reasons = [c["choices"][0]["finish_reason"] for c in self.chunks[i] if c["choices"]]
        return next((r for r in reversed(reasons) if r is not None), None)

    def usage(self, i: int) -> dict | None:
        return next((c["usage"] for c in reversed(self.chunks[i]) if c.get("usage")), None)


def _wait(cond, timeout: float, what: str, srv: ServerProcess) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out ({timeout}s) waiting for {what}:\n{srv.log()[-3000:]}")
        if srv.proc.poll() is not None:
            raise AssertionError(f"server exited ({srv.proc.returncode}) waiting for {what}:\n{srv.log()[-3000:]}")
        time.sleep(0.05)


def _assert_openai_503(r: httpx.Response) -> dict:
    assert r.status_code == 503, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "service_unavailable" and err["code"] == "service_unavailable", err
    return err


def _start(tmp_path, *args) -> ServerProcess:
    # One torch thread: on an oversubscribed CPU, 2 threads per step made decoding ~4x slower.
    return ServerProcess(tmp_path / "server.log", *SMALL, "--max-num-seqs", str(N_STREAMS), "--num-threads", "1",
                         *args, timeout=300)


def _wait_exit(srv: ServerProcess, timeout: float) -> int:
    try:
        return srv.proc.wait(timeout)
    except Exception:
        raise AssertionError(f"server still running {timeout}s after the signal:\n{srv.log()[-3000:]}") from None


def test_sigterm_keeps_listening_while_draining_then_exits_0(tmp_path):
    srv = _start(tmp_path, "--drain-timeout", "600")
    try:
        streams = Streams(srv.url, N_STREAMS, max_tokens=TOKENS)
        _wait(streams.all_started, 180, "all streams generating", srv)
        srv.proc.send_signal(signal.SIGTERM)

        # /health: 503 with the draining message (not a refused connection) while streams run.
        seen_503_while_running = False
        health_msg = None
        deadline = time.monotonic() + 10
        while not seen_503_while_running and time.monotonic() < deadline:
            running_before = streams.running()
            r = httpx.get(srv.url + "/health", timeout=10)      # a ConnectError here fails the test
            if r.status_code == 503:
                health_msg = _assert_openai_503(r)["message"]
                seen_503_while_running = running_before > 0 and streams.running() > 0
            time.sleep(0.05)
        assert seen_503_while_running, (health_msg, streams.running(), srv.log()[-3000:])
        assert health_msg.startswith("The server is draining: ") and "request(s) in flight" in health_msg, health_msg
        assert "no new requests are accepted" in health_msg

        # A new generation request: 503 in OpenAI's shape.
        assert streams.running() > 0
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4},
                       timeout=10)
        _assert_openai_503(r)
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=10, json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
        _assert_openai_503(r)
        assert streams.running() > 0, "the streams ended before the draining checks; make them longer"

        # The streams finish normally.
        streams.join(600)
        assert not any(t.is_alive() for t in streams.threads), srv.log()[-3000:]
        for i in range(N_STREAMS):
            assert streams.errors[i] is None and streams.done[i], (i, streams.errors[i], srv.log()[-3000:])
            assert streams.finish_reason(i) == "length", (i, streams.chunks[i][-3:])
            assert streams.usage(i)["completion_tokens"] == TOKENS, streams.usage(i)

        # Then the process exits 0 and the port is closed.
        rc = _wait_exit(srv, 60)
        assert rc == 0, srv.log()[-3000:]
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url + "/health", timeout=5)
        log = srv.log()
        assert "draining" in log and "drained" in log and "drain: aborting" not in log
        assert "Traceback" not in log, log[-3000:]
    finally:
        srv.terminate(10)


def test_drain_timeout_aborts_streams_then_exits_0(tmp_path):
    srv = _start(tmp_path, "--drain-timeout", "2")
    try:
        streams = Streams(srv.url, N_STREAMS, max_tokens=900)
        _wait(streams.all_started, 180, "all streams generating", srv)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        r = httpx.get(srv.url + "/health", timeout=10)
        assert "draining" in _assert_openai_503(r)["message"]
        streams.join(120)
        rc = _wait_exit(srv, 60)
        took = time.monotonic() - t0
        assert rc == 0, srv.log()[-3000:]
        assert 2 <= took < 2 + 90, took
        for i in range(N_STREAMS):
            assert streams.errors[i] is None and streams.done[i], (i, streams.errors[i], srv.log()[-3000:])
            assert streams.finish_reason(i) == "abort", (i, streams.chunks[i][-3:])
            assert 0 < streams.usage(i)["completion_tokens"] < 900, streams.usage(i)
            assert streams.ended_at[i] - t0 >= 2        # ran until the drain timeout
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url + "/health", timeout=5)
        log = srv.log()
        assert f"drain: aborting {N_STREAMS} request(s)" in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
    finally:
        srv.terminate(10)


def test_second_signal_stops_at_once(tmp_path):
    srv = _start(tmp_path, "--drain-timeout", "120")
    try:
        streams = Streams(srv.url, N_STREAMS, max_tokens=900)
        _wait(streams.all_started, 180, "all streams generating", srv)
        srv.proc.send_signal(signal.SIGTERM)
        _assert_openai_503(httpx.get(srv.url + "/health", timeout=10))
        srv.proc.send_signal(signal.SIGINT)
        rc = _wait_exit(srv, 60)           # the engine's own shutdown takes seconds on a busy CPU
        assert rc == 0, srv.log()[-3000:]
        streams.join(30)
        assert not any(t.is_alive() for t in streams.threads)
        # Cut short: a stream ends with "abort" (or, if its last chunk did not make it out, not at all).
        for i in range(N_STREAMS):
            assert streams.finish_reason(i) in ("abort", None), (i, streams.chunks[i][-3:])
            assert not (streams.errors[i] is None and streams.finish_reason(i) is None), i
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url + "/health", timeout=5)
        log = srv.log()
        assert "stopping now" in log and "Traceback" not in log, log[-3000:]
    finally:
        srv.terminate(10)
