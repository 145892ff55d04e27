"""Two "nodes" on one machine: two network namespaces joined by a veth pair.

Tests and benchmarks of multi-node code (tensor parallelism over a link
between two boxes) run one process per namespace; each namespace has only its
own loopback and its end of the link, so traffic between the two can only go
over the veth pair (the root namespace cannot reach either address).

    from netns import netns_unavailable, two_nodes
    if (why := netns_unavailable()):
        pytest.skip(why)
    with two_nodes() as (a, b):
        srv = a.popen([sys.executable, "server.py", a.addr])
        b.run([sys.executable, "client.py", a.addr], check=True, timeout=10)

Needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN) and iproute2's `ip`. Names carry
the pid and a per-process counter, so parallel tests do not clash; addresses
are 10.201.X.1/24 (node A) and 10.201.X.2/24 (node B). On exit every process
still in either namespace is killed and both namespaces are deleted (which
removes the veth pair), also when the body raises.
"""
import itertools
import os
import shutil
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache

_IP_TIMEOUT = 10          # s, per `ip` call
_KILL_WAIT = 5            # s, for killed processes to go away
_counter = itertools.count()


def _ip(*args: str, check: bool = True, timeout: float = _IP_TIMEOUT) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({r.returncode}): {(r.stderr or r.stdout).strip()}")
    return r


@dataclass
class Node:
    name: str        # the namespace (`ip netns exec NAME ...`)
    addr: str        # its IPv4 address on the link
    ifname: str      # its veth end inside the namespace (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)
    _procs: list = field(default_factory=list, repr=False)

    def argv(self, argv) -> list[str]:
        return ["ip", "netns", "exec", self.name, *map(str, argv)]

    def popen(self, argv, **kw) -> subprocess.Popen:
        """subprocess.Popen of argv inside this namespace (`ip netns exec`
        execs argv, so the Popen's pid is argv's own)."""
        p = subprocess.Popen(self.argv(argv), **kw)
        self._procs.append(p)
        return p

    def run(self, argv, **kw) -> subprocess.CompletedProcess:
        """subprocess.run of argv inside this namespace."""
        return subprocess.run(self.argv(argv), **kw)

    def pids(self) -> list[int]:
        r = _ip("netns", "pids", self.name, check=False)
        return [int(x) for x in r.stdout.split() if x.isdigit()]


@lru_cache(maxsize=1)
def netns_unavailable() -> str | None:
    """Why two_nodes() cannot work here (a sentence), or None when it can:
    tries to make (and then deletes) two namespaces joined by a veth pair."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return "no Linux network namespaces on this system"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN)"
    a, b = _names()[:2]
    try:
        for ns in (a, b):
            r = _ip("netns", "add", ns, check=False)
            if r.returncode:
                return f"`ip netns add` failed: {(r.stderr or r.stdout).strip()}"
        va, vb = _ifnames()
        r = _ip("link", "add", va, "netns", a, "type", "veth", "peer", "name", vb, "netns", b, check=False)
        if r.returncode:
            return f"cannot create a veth pair between namespaces: {(r.stderr or r.stdout).strip()}"
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"`ip` failed: {e}"
    finally:
        for ns in (a, b):
            _ip("netns", "del", ns, check=False)


def _names() -> tuple[str, str, int]:
    n = next(_counter)
    return f"tq{os.getpid()}-{n}a", f"tq{os.getpid()}-{n}b", n


def _ifnames() -> tuple[str, str]:
    # Made directly inside the namespaces, so they only need to be unique there;
    # at most 15 characters (IFNAMSIZ).
    return "tqveth-a", "tqveth-b"


def _kill_all(node: Node) -> None:
    """SIGKILL whatever still runs in the namespace (and the Popen's this node
    made), then reap them; bounded by _KILL_WAIT."""
    for p in node._procs:
        if p.poll() is None:
            try:
                p.kill()
            except OSError:
                pass
    pids = set(node.pids())
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + _KILL_WAIT
    for p in node._procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    while pids and time.monotonic() < deadline:   # others (children of children) leave the namespace
        pids = set(node.pids())
        if pids:
            time.sleep(0.05)


@contextmanager
def two_nodes():
    """(Node A, Node B): two fresh namespaces, loopback up in both, joined by
    a veth pair (A: 10.201.X.1/24, B: 10.201.X.2/24). Deleted on exit."""
    na, nb, n = _names()
    x = (os.getpid() + n) % 254 + 1
    ia, ib = _ifnames()
    a, b = Node(na, f"10.201.{x}.1", ia), Node(nb, f"10.201.{x}.2", ib)
    made = []
    try:
        for node in (a, b):
            _ip("netns", "add", node.name)
            made.append(node)
        _ip("link", "add", ia, "netns", na, "type", "veth", "peer", "name", ib, "netns", nb)
        for node in (a, b):
            _ip("-n", node.name, "link", "set", "lo", "up")
            _ip("-n", node.name, "addr", "add", f"{node.addr}/24", "dev", node.ifname)
            _ip("-n", node.name, "link", "set", node.ifname, "up")
        yield a, b
    finally:
        for node in made:
            try:
                _kill_all(node)
            finally:
                _ip("netns", "del", node.name, check=False)
