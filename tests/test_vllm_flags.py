"""vLLM's command-line flags (server/vllm_flags.py, server/cli.py): a vLLM
command line, or its `--config` YAML file, starts tqserve as it is; what it
asks that tqserve cannot do stops it with one line (exit 2). One real server
(SmolLM2) over a Unix socket runs the honoured ones: --config with flags
given again on the command line winning, --chat-template, --response-role,
--enable-request-id-headers, --enable-force-include-usage,
--disable-log-requests, GET /load; --tokenizer offline; the periodic stats
line against a stand-in engine."""
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from server.cli import _switches, build_parser
from server.vllm_flags import expand_config, refused
from tests.test_server_process import REPO, SMALL

PARSER = build_parser()


def parse(*argv):
    return PARSER.parse_args(["serve", *expand_config(list(argv), _switches(PARSER))])


def test_config_file_flags_and_the_command_line_wins(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": "smollm2-135m", "max_num_seqs": 4, "enable_chunked_prefill": True,
                                   "enable_prefix_caching": False, "trust_remote_code": True,
                                   "disable_log_requests": False, "served-model-name": ["a", "b"],
                                   "kv_cache_memory_bytes": "64MiB", "swap_space": 16}))
    a = parse("--config", str(cfg), "--max-num-seqs", "8")
    assert (a.model, a.max_num_seqs, a.served_model_name, a.kv_cache_memory) == ("smollm2-135m", 8, ["a", "b"],
                                                                                 64 << 20)
    assert a.enable_prefix_caching is False and a.trust_remote_code and not a.disable_log_requests
    assert refused(a) is None
    cfg.write_text("enable_prefix_caching: 3\n")
    with pytest.raises(ValueError, match="is a switch"):
        expand_config(["--config", str(cfg)], _switches(PARSER))
    cfg.write_text("- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        expand_config(["--config", str(cfg)], _switches(PARSER))


@pytest.mark.parametrize("argv, words", [
    (["--enable-chunked-prefill", "--swap-space", "4", "--disable-custom-all-reduce", "--download-dir", "/x",
      "--tokenizer-mode", "auto", "--distributed-executor-backend", "mp", "--pipeline-parallel-size", "1",
      "--limit-mm-per-prompt", '{"image": 0}', "--compilation-config", "{}", "--task", "generate",
      "--tool-call-parser", "llama4_pythonic", "--chat-template-content-format", "openai"], None),
    (["--no-enable-chunked-prefill"], "chunked prefill is always on"),
    (["--pipeline-parallel-size", "2"], "--tensor-parallel-size"),
    (["--data-parallel-size", "2"], "one server per replica"),
    (["--distributed-executor-backend", "ray"], "--nnodes"),
    (["--revision", "main"], "local directory"),
    (["--compilation-config", '{"level": 3}'], "torch.compile"),
    (["--logprobs-mode", "processed_logits"], "logprobs"),
    (["--kv-transfer-config", '{"kv_connector": "x"}'], "KV transfer"),
])
def test_vllm_flags_accepted_or_refused(argv, words):
    reason = refused(parse(*argv))
    assert (reason is None) if words is None else (words in reason and reason.startswith("--")), reason


def test_refused_flag_is_one_line_at_start():
    r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", "0", "--data-parallel-size", "2"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "--data-parallel-size 2" in lines[0], r.stderr


def test_a_vllm_command_line_over_a_unix_socket(tmp_path):
    sock = tmp_path / "tq.sock"
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                   "{% if add_generation_prompt %}[assistant]{% endif %}")
    cfg = tmp_path / "vllm.yaml"
    cfg.write_text(yaml.safe_dump({"chat-template": str(tpl), "response-role": "bot", "served-model-name": "cfg",
                                   "enable-request-id-headers": True, "enable-force-include-usage": True,
                                   "disable-log-requests": True, "enable-chunked-prefill": True,
                                   "uvicorn-log-level": "warning", "disable-uvicorn-access-log": True,
                                   "prefix-cache-file": str(tmp_path / "prefix.pt")}))
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--uds", str(sock), "--config", str(cfg),
                             *SMALL, "--served-model-name", "smollm2-135m", "--enable-auto-tool-choice",
                             "--trust-remote-code"],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={k: v for k, v in os.environ.items() if k != "TQSERVE_API_KEY"})
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://tq", timeout=120)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        text = (tmp_path / "server.log").read_text()
        assert f"listening on http+unix://{sock}" in text
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["smollm2-135m"]   # the command line's
        r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi there"}],
                                           "add_special_tokens": False}).json()
        assert client.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == \
            "[user] Hi there\n[assistant]"
        body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        r = client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "mine-1"})
        assert r.json()["choices"][0]["message"]["role"] == "bot" and r.headers["x-request-id"] == "mine-1"
        r = client.post("/v1/chat/completions", json={**body, "stream": True})
        assert len(r.headers["x-request-id"]) == 32
        chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
        assert chunks[0]["choices"][0]["delta"]["role"] == "bot"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3    # unasked
        assert client.get("/load").json() == {"server_load": 0}
    finally:
        proc.terminate()
        assert proc.wait(60) == 0
        client.close()
        log.close()
    text = (tmp_path / "server.log").read_text()
    assert " chat prompt_tokens=" not in text and "stopped" in text       # no request lines
    assert (tmp_path / "prefix.pt").stat().st_size > 0 and "blocks written to" in text     # saved at shutdown


def test_tokenizer_flag(tmp_path):
    from engine import LLM, SamplingParams
    from tests.fixtures_models import hf_tokenizer, write_tiny_llama
    write_tiny_llama(tmp_path / "m", sharded=False, with_tokenizer=False)
    hf_tokenizer("smollm2-135m").save_pretrained(tmp_path / "tok")
    assert LLM(str(tmp_path / "m"), kv_cache_memory=4 << 20).tokenizer is None
    llm = LLM(str(tmp_path / "m"), kv_cache_memory=4 << 20, tokenizer=str(tmp_path / "tok"))
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.prompt_token_ids == hf_tokenizer("smollm2-135m").encode("Hello there") and out.outputs[0].text
    assert llm.chat_template is not None and "im_start" in llm.chat_template
    with pytest.raises(Exception, match="no tokenizer.json"):
        LLM(str(tmp_path / "m"), kv_cache_memory=4 << 20, tokenizer=str(tmp_path / "m"))


class _Stats:
    def __init__(self):
        self.s = {"prompt_tokens_total": 0, "generation_tokens_total": 0, "num_running": 0, "num_waiting": 0,
                  "kv_cache_usage": 0.0, "prefix_cache_queries_total": 0, "prefix_cache_hits_total": 0}

    def stats(self):
        return self.s


def test_stats_line_while_busy_and_once_after():
    from types import SimpleNamespace

    from server.stats_log import StatsLogger
    llm = _Stats()
    sl = StatsLogger(SimpleNamespace(llm=llm))
    assert sl.line() is None                    # idle
    llm.s.update(prompt_tokens_total=1000, generation_tokens_total=200, num_running=3, num_waiting=1,
                 kv_cache_usage=0.25, prefix_cache_queries_total=100, prefix_cache_hits_total=40)
    sl.t -= 10
    line = sl.line()
    assert "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 40.0%" in line
    assert "Avg prompt throughput: 10" in line and "Avg generation throughput: 2" in line     # ~100 and ~20 /s
    llm.s.update(num_running=0, num_waiting=0)
    assert sl.line() is not None                # the interval it ended in
    assert sl.line() is None


def test_chat_template_content_format_openai():
    """--chat-template-content-format openai: the template gets content as a
    list of text parts (templates written for OpenAI's shape loop over it)."""
    from tests.test_server_fake_engine import FakeAsyncLLM, LiveServer
    template = ("{% for m in messages %}<{{ m['role'] }}>{% for p in m['content'] %}[{{ p['type'] }}:"
                "{{ p['text'] }}]{% endfor %}{% endfor %}")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]
    # (a string under such a template: its characters, each without type or text)
    for fmt, want in (("openai", "<user>[text:hi]<assistant>[text:yo]"), ("auto", "<user>[:][:]<assistant>[:][:]")):
        srv = LiveServer(FakeAsyncLLM(), chat_template_content_format=fmt)
        srv.llm.chat_template = template
        try:
            ids = httpx.post(srv.url + "/tokenize", json={"messages": msgs, "add_special_tokens": False,
                                                          "add_generation_prompt": False}).json()["tokens"]
            assert srv.llm.tokenizer.decode(ids) == want
        finally:
            srv.stop()


def test_exclude_tools_when_tool_choice_none():
    from tests.test_server_fake_engine import FakeAsyncLLM, LiveServer
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "tools": [tool], "max_tokens": 1}
    for exclude in (False, True):
        srv = LiveServer(FakeAsyncLLM(), exclude_tools_when_tool_choice_none=exclude)
        srv.llm.chat_template = "{% if tools %}[{{ tools[0]['function']['name'] }}]{% endif %}{{ messages[0]['content'] }}"
        try:
            shown = []
            for choice in ("none", "auto"):
                assert httpx.post(srv.url + "/v1/chat/completions", json={**body, "tool_choice": choice}).status_code \
                    == 200
                shown.append("get_weather" in srv.llm.tokenizer.decode(srv.llm.prompts[-1]))
            assert shown == [not exclude, True]
        finally:
            srv.stop()


def test_vllm_tool_parser_names():
    from server.cli import tool_aliases_of
    from server.tool_parsers import PARSERS
    assert [tool_aliases_of(n) for n in ("llama4_json", "llama4_pythonic", "qwen3_xml", "hermes", None)] == \
        ["llama3_json", "pythonic", "qwen3_coder", "hermes", None]
    assert all(tool_aliases_of(n) in PARSERS for n in ("llama4_json", "llama4_pythonic", "qwen3_xml"))


def test_stream_interval(tmp_path):
    """--stream-interval N (vLLM's): a stream's outputs gather N tokens; the
    first and the last go at once, the tokens are the same."""
    import asyncio

    from engine import AsyncLLM, EngineArgs, SamplingParams
    from tests.tiny_models import save_tiny_llama
    save_tiny_llama(tmp_path)
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    async def main():
        counts = {}
        for interval in (1, 4):
            eng = AsyncLLM(EngineArgs(model=str(tmp_path), dtype="float32", kv_cache_memory=4 << 20,
                                      stream_interval=interval))
            await eng.start()
            try:
                outs = [o async for o in eng.generate([5, 6, 7, 8], sp, "r")]
                counts[interval] = ([len(o.outputs[0].token_ids) for o in outs], outs[-1].outputs[0].token_ids)
            finally:
                await eng.shutdown()
        return counts
    counts = asyncio.run(main())
    assert counts[1][0] == list(range(1, 11))
    assert counts[4][0] == [1, 5, 9, 10] and counts[4][1] == counts[1][1]
    with pytest.raises(ValueError, match="stream_interval"):
        EngineArgs(model=str(tmp_path), stream_interval=0).validate()
