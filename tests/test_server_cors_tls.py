"""CORS (vLLM's --allowed-origins / -methods / -headers, --allow-credentials)
and TLS (--ssl-certfile, --ssl-keyfile, --ssl-ca-certs, --ssl-cert-reqs)."""
import ssl
import subprocess
import sys

import httpx
import openai
import pytest
import trustme

from tests.test_server_fake_engine import FakeAsyncLLM, LiveServer
from tests.test_server_process import REPO, SMALL, ServerProcess

PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}


def test_any_origin_by_default_and_errors_carry_the_headers():
    srv = LiveServer(FakeAsyncLLM(), api_keys=["k"])
    try:
        # A browser's preflight has no API key: answered before the key check.
        pre = httpx.options(srv.url + "/v1/chat/completions", headers={"Origin": "http://app.example", **PREFLIGHT})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        # A 401 must be readable by the page too.
        r = httpx.get(srv.url + "/v1/models", headers={"Origin": "http://app.example"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
        r = httpx.get(srv.url + "/v1/models", headers={"Origin": "http://app.example", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-credentials" not in r.headers
        assert "access-control-allow-origin" not in httpx.get(srv.url + "/health").headers   # no Origin, no CORS
    finally:
        srv.stop()


def test_origins_can_be_restricted():
    srv = LiveServer(FakeAsyncLLM(), allowed_origins=["http://app.example"], allow_credentials=True,
                     allowed_methods=["GET", "POST"], allowed_headers=["Authorization", "Content-Type"])
    try:
        ok = httpx.options(srv.url + "/v1/completions", headers={"Origin": "http://app.example", **PREFLIGHT})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://app.example"
        assert ok.headers["access-control-allow-credentials"] == "true"
        bad = httpx.options(srv.url + "/v1/completions", headers={"Origin": "http://evil.example", **PREFLIGHT})
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
        put = httpx.options(srv.url + "/v1/completions", headers={
            "Origin": "http://app.example", "Access-Control-Request-Method": "PUT"})
        assert put.status_code == 400
        r = httpx.get(srv.url + "/v1/models", headers={"Origin": "http://evil.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    finally:
        srv.stop()


def test_cli_flags(capsys):
    from server.cli import build_parser
    a = build_parser().parse_args(["serve", "--allowed-origins", '["http://a.example"]', "--allow-credentials",
                                   "--ssl-certfile", "c.pem", "--ssl-cert-reqs", "2", "--root-path", "/llm"])
    assert (a.allowed_origins, a.allowed_methods, a.allow_credentials) == (["http://a.example"], None, True)
    assert (a.ssl_certfile, a.ssl_keyfile, a.ssl_cert_reqs, a.root_path) == ("c.pem", None, 2, "/llm")
    for bad in ('"*"', "[1]", "[*]"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--allowed-origins", bad])
        assert "--allowed-origins" in capsys.readouterr().err


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server, client = ca.issue_cert("127.0.0.1"), ca.issue_cert("client.example")
    ca.cert_pem.write_to_path(d / "ca.pem")
    server.private_key_pem.write_to_path(d / "server.key")
    for blob in server.cert_chain_pems:
        blob.write_to_path(d / "server.pem", append=True)
    client.private_key_and_cert_chain_pem.write_to_path(d / "client.pem")
    return d


def test_https_with_client_certificates(tmp_path, pki):
    ca = str(pki / "ca.pem")
    with_cert = ssl.create_default_context(cafile=ca)
    with_cert.load_cert_chain(pki / "client.pem")
    srv = ServerProcess(tmp_path / "log", "--ssl-keyfile", str(pki / "server.key"), "--ssl-certfile",
                        str(pki / "server.pem"), "--ssl-ca-certs", ca, "--ssl-cert-reqs", "2", *SMALL,
                        verify=with_cert)
    try:
        assert srv.url.startswith("https://127.0.0.1:")
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                               http_client=httpx.Client(verify=with_cert))
        r = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4 and r.choices[0].message.content
        # No client certificate, a server certificate nobody vouched for, plain HTTP: all refused.
        for verify in (ssl.create_default_context(cafile=ca), True):
            with pytest.raises(httpx.HTTPError):
                httpx.get(srv.url + "/health", verify=verify, timeout=10).raise_for_status()
        with pytest.raises(httpx.HTTPError):
            httpx.get(srv.url.replace("https", "http") + "/health", timeout=10).raise_for_status()
        assert httpx.get(srv.url + "/health", verify=with_cert, timeout=10).status_code == 200
    finally:
        assert srv.terminate() == 0


@pytest.mark.parametrize("flags, words", [
    (["--ssl-certfile", "{garbage}"], "cannot use the TLS certificate or key"),
    (["--ssl-keyfile", "{garbage}"], "--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile"),
])
def test_bad_tls_settings_fail_at_start(tmp_path, flags, words):
    (tmp_path / "garbage.pem").write_text("not a certificate\n")
    flags = [f.format(garbage=tmp_path / "garbage.pem") for f in flags]
    p = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", "0", *flags],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    # A one-line error and exit 2, before any weights are read.
    assert p.returncode == 2 and words in p.stderr and "tensors" not in p.stderr
