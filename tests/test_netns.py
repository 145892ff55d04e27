"""tests/netns.py: two namespaces talk over their veth link and only there."""
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns import netns_unavailable, two_nodes  # noqa: E402

SERVER = ("import socket, sys; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
          "s.bind((sys.argv[1], 0)); s.listen(4); print(s.getsockname()[1], flush=True); "
          "c, _ = s.accept(); c.sendall(b'pong:' + c.recv(64)); c.close()")
CLIENT = ("import socket, sys; c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3); "
          "c.sendall(b'ping'); print(c.recv(64).decode())")


def test_two_nodes_talk_over_the_link_only():
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    t0 = time.monotonic()
    with two_nodes() as (a, b):
        assert a.name != b.name and a.addr != b.addr
        srv = a.popen([sys.executable, "-c", SERVER, a.addr], stdout=subprocess.PIPE, text=True)
        port = int(srv.stdout.readline())
        # The root namespace has no route to the link: connecting fails fast (or times out).
        with pytest.raises(OSError):
            socket.create_connection((a.addr, port), timeout=0.5).close()
        r = b.run([sys.executable, "-c", CLIENT, a.addr, str(port)], capture_output=True, text=True, timeout=10)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "pong:ping"
        assert srv.wait(5) == 0
        left = a.name, b.name
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in names.split() for n in left)
    assert time.monotonic() - t0 < 5


def test_cleanup_when_the_body_raises():
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    with pytest.raises(RuntimeError):
        with two_nodes() as (a, b):
            sleeper = a.popen(["sleep", "60"])
            left = a.name, b.name
            raise RuntimeError("body failed")
    assert sleeper.poll() is not None
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in names.split() for n in left)
