"""`tqserve serve` as a subprocess for the HTTP tests (ServerProcess), and tests
of the CLI's own parsing."""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]

# Small settings: the test machine is a shared 2-core CPU.
SMALL = ["--max-model-len", "1024", "--kv-cache-memory", "192MiB", "--max-num-batched-tokens", "512"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """Starts `python -m server.cli serve --port 0 ...` on 127.0.0.1, learns the URL
    from its first log line, and waits for /health (unless wait=False)."""
    verify = True           # httpx's: a CA file or SSL context for an https server

    def __init__(self, log_path: Path, *args: str, env: dict | None = None, wait: bool = True,
                 timeout: float = 300, verify=True):
        self.log_path = log_path
        self.verify = verify
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "server.cli", "serve", "--model", "smollm2-135m", "--host", "127.0.0.1",
               "--port", "0", *args]
        e = dict(os.environ)
        e.pop("TQSERVE_API_KEY", None)
        e.update(env or {})
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=e)
        self.url = self._wait_url(60)
        if wait:
            self.wait_ready(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_url(self, timeout: float) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = re.search(r"listening on (https?://127\.0\.0\.1:\d+)", self.log())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"server did not start:\n{self.log()[-4000:]}")

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2, verify=self.verify).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready in {timeout}s:\n{self.log()[-4000:]}")

    def terminate(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    stop = terminate

    def metrics(self) -> dict:
        """{(name, frozenset(labels)): value} of /metrics, parsed with prometheus_client's parser."""
        from prometheus_client.parser import text_string_to_metric_families
        out = {}
        for fam in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=10).text):
            for s in fam.samples:
                labels = {k: v for k, v in s.labels.items() if k != "model_name"}
                out[(s.name, frozenset(labels.items()))] = s.value
        return out


def metric(m: dict, name: str, **labels) -> float:
    return m.get((name, frozenset(labels.items())), 0.0)


# --------------------------------------------------------------------------
def test_parse_bytes_or_fraction():
    from server.cli import parse_bytes_or_fraction as p
    assert p("0.25") == 0.25
    assert p("2000000") == 2000000
    assert p("512MiB") == 512 << 20 and p("512M") == 512 << 20
    assert p("2GB") == 2_000_000_000 and p("1.5GiB") == int(1.5 * (1 << 30))
    with pytest.raises(Exception):
        p("lots")


def test_cli_help_and_bad_port(tmp_path):
    r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--max-queue" in r.stdout and "--api-key" in r.stdout
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", str(port)], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot listen" in r.stderr


def test_chat_template_flag(tmp_path):
    """--chat-template (vLLM's): one that does not compile, or a value that is
    neither a file nor a template, is one startup error (exit 2); a file's
    template serving chat: test_vllm_flags.py's server."""
    for bad, why in (("{% if %}", "does not compile"), ("no-such-file.jinja", "neither a file nor")):
        r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", "0", "--chat-template", bad],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and why in r.stderr, r.stderr[-2000:]
