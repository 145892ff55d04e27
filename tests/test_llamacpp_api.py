"""llama.cpp's native API (server/llamacpp_api.py) over real HTTP against the
stand-in engine of test_server_fake_engine.py: /completion's and /infill's
response and stream shapes, llama.cpp's sampling defaults and names, its
n_indent and t_max_predict_ms stops (the engine request is aborted there),
errors, /props and the tokenize spellings. The real-model checks (infill and
/completion tokens and logprobs against transformers) are in test_fim.py."""
import json
import time

import httpx
import pytest

from tests.test_server_fake_engine import FakeAsyncLLM, LiveServer

SCRIPT = "    a = 1\n    b = 2\nc = 3\n"


@pytest.fixture(scope="module")
def live():
    srv = LiveServer(FakeAsyncLLM(script=SCRIPT), api_keys=[])
    yield srv
    srv.stop()


def _post(live, path, body, **kw):
    return httpx.post(live.url + path, json=body, timeout=30, **kw)


def _events(live, path, body) -> list[dict]:
    """A native stream's events: `data:` lines only, no [DONE]."""
    with httpx.stream("POST", live.url + path, json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    assert "[DONE]" not in text
    blocks = [b for b in text.split("\n\n") if b]
    assert all(b.startswith("data: ") for b in blocks)
    return [json.loads(b[6:]) for b in blocks]


def test_completion_shape_and_llama_defaults(live):
    r = _post(live, "/completion", {"prompt": "hi", "return_tokens": True})
    assert r.status_code == 200
    b = r.json()
    assert b["content"] == SCRIPT and b["stop"] is True and b["stop_type"] == "eos" and b["stopping_word"] == ""
    # the end-of-text token counts as generated (as llama.cpp and vLLM count it)
    assert b["tokens"] == [c + 4 for c in SCRIPT.encode()] + [3] and b["tokens_predicted"] == len(SCRIPT) + 1
    assert b["tokens_evaluated"] == 3 and b["prompt"] == "<s>hi" and b["has_new_line"] is True
    t = b["timings"]
    assert t["predicted_n"] == len(SCRIPT) + 1 and t["prompt_n"] == 3 and t["predicted_ms"] > 0
    p = live.llm.params[-1]
    # llama.cpp's defaults, not the OpenAI endpoints' neutral ones
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.max_tokens, p.seed) == (0.8, 40, 0.95, 0.05, None, None)
    r = _post(live, "/completions", {"prompt": [1, "x"], "n_predict": 3, "temperature": 0, "top_k": 0,
                                     "repeat_penalty": 1.1, "seed": 7, "logit_bias": [[5, False], ["ab", 2]]})
    assert r.status_code == 200 and r.json()["content"] == SCRIPT[:3] and r.json()["stop_type"] == "limit"
    p = live.llm.params[-1]
    assert live.llm.prompts[-1] == [1, ord("x") + 4]        # mixed: ids as they are, text without a start token
    assert (p.temperature, p.top_k, p.repetition_penalty, p.seed, p.max_tokens) == (0.0, 0, 1.1, 7, 3)
    assert p.logit_bias == {5: -100.0, ord("a") + 4: 2.0, ord("b") + 4: 2.0}     # false: never; text: its tokens


def test_several_prompts_stop_words_and_fields(live):
    r = _post(live, "/completion", {"prompt": ["x", [7, 8]], "stop": ["b ="], "n_probs": 2})
    assert r.status_code == 200
    bodies = r.json()
    assert [b["index"] for b in bodies] == [0, 1]
    for b in bodies:
        assert b["content"] == "    a = 1\n    " and b["stop_type"] == "word" and b["stopping_word"] == "b ="
        probs = b["completion_probabilities"]
        assert len(probs) == b["tokens_predicted"] and probs[0]["id"] == ord(" ") + 4
        assert [e["id"] for e in probs[0]["top_logprobs"]] == [ord(" ") + 4, ord("a") + 4]
        assert probs[0]["top_logprobs"][0]["logprob"] == -0.25
    r = _post(live, "/completion", {"prompt": "x", "response_fields": ["content", "timings/predicted_n", "nope"]})
    assert r.json() == {"content": SCRIPT, "timings/predicted_n": len(SCRIPT) + 1}
    r = _post(live, "/completion", {"prompt": "x", "n_predict": 0})     # prompt only (editors warm the cache)
    assert r.json()["content"] == "" and r.json()["tokens_predicted"] == 0


def _finished(live, reason) -> float:
    text = httpx.get(live.url + "/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("tqserve:request_success_total{")
                and f'finished_reason="{reason}"' in x)
    return float(line.rsplit(" ", 1)[1])


def test_n_indent_ends_at_a_line_indented_less(live):
    before = len(live.llm.aborted)
    stops, aborts = _finished(live, "stop"), _finished(live, "abort")
    b = _post(live, "/completion", {"prompt": "x", "n_indent": 4}).json()
    assert b["content"] == "    a = 1\n    b = 2\n" and b["stop_type"] == "limit"
    assert len(live.llm.aborted) == before + 1       # the engine stopped generating there
    time.sleep(0.2)     # (the metrics are recorded as the request's generator closes)
    assert _finished(live, "stop") == stops + 1 and _finished(live, "abort") == aborts    # a stop, not an abort
    ev = _events(live, "/completion", {"prompt": "x", "n_indent": 4, "stream": True, "timings_per_token": True})
    assert all(e["stop"] is False and "timings" in e for e in ev[:-1])
    assert "".join(e["content"] for e in ev) == b["content"]
    assert ev[-1]["stop"] is True and ev[-1]["content"] == "" and ev[-1]["stop_type"] == "limit"
    assert _post(live, "/completion", {"prompt": "x", "n_indent": 2}).json()["content"] == "    a = 1\n    b = 2\n"
    assert _post(live, "/completion", {"prompt": "x", "n_indent": 5}).json()["content"] == "    a = 1\n    "


def test_t_max_predict_ms_ends_after_a_line(live):
    b = _post(live, "/completion", {"prompt": "x", "t_max_predict_ms": 1}).json()
    assert b["stop_type"] == "limit" and b["content"].startswith("    a = 1\n") and len(b["content"]) < len(SCRIPT)
    assert _post(live, "/completion", {"prompt": "x", "t_max_predict_ms": 60000}).json()["content"] == SCRIPT


def test_stream_equals_nonstream(live):
    ev = _events(live, "/completion", {"prompt": "x", "n_predict": 8, "n_probs": 1, "return_tokens": True,
                                        "stream": True})
    assert "".join(e["content"] for e in ev) == SCRIPT[:8]
    assert [t for e in ev for t in e["tokens"]] == [c + 4 for c in SCRIPT[:8].encode()]
    assert sum(len(e.get("completion_probabilities", [])) for e in ev) == 8
    assert ev[-1]["tokens_predicted"] == 8 and ev[-1]["timings"]["predicted_n"] == 8


@pytest.mark.parametrize("body, needle", [
    ({"prompt": "x", "mirostat": 2}, "mirostat"),
    ({"prompt": "x", "dry_multiplier": 0.8}, "dry_multiplier"),
    ({"prompt": "x", "post_sampling_probs": True}, "post_sampling_probs"),
    ({"prompt": "x", "lora": [{"id": 0, "scale": 1.0}]}, "lora"),
    ({"prompt": ""}, "prompt must not be empty"),
    ({"prompt": "x", "logit_bias": [[5]]}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": True}}, "logit_bias"),
    ({"prompt": "x", "grammar": "root ::= \"a\"", "json_schema": {}}, "grammar or json_schema"),
    ({"prompt": "x", "n_probs": 50}, "n_probs"),
    ({"prompt": [300]}, "out of vocabulary"),
    ({"prompt": "x" * 300}, "maximum context length"),
])
def test_errors(live, body, needle):
    r = _post(live, "/completion", body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_infill_needs_fim_tokens(live):
    r = _post(live, "/infill", {"input_prefix": "def f():", "input_suffix": ""})
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]
    r = _post(live, "/infill", {"input_prefix": "def f():"})
    assert r.status_code == 400 and "input_suffix" in r.json()["error"]["message"]


def test_props_and_tokenize_spellings(live):
    p = httpx.get(live.url + "/props").json()
    assert p["default_generation_settings"]["n_ctx"] == live.llm.max_model_len and p["infill"] is False
    assert p["total_slots"] == live.llm.max_num_seqs
    t = _post(live, "/tokenize", {"content": "ab", "with_pieces": True}).json()
    assert t["tokens"] == [{"id": ord("a") + 4, "piece": "a"}, {"id": ord("b") + 4, "piece": "b"}]
    assert _post(live, "/tokenize", {"content": "ab", "add_special": True}).json()["tokens"][0] == 1
    assert _post(live, "/detokenize", {"tokens": [ord("a") + 4]}).json() == {"prompt": "a", "content": "a"}


def test_native_routes_need_the_api_key():
    srv = LiveServer(FakeAsyncLLM(script="ok"), api_keys=["sk-test"])
    try:
        for path, body in (("/completion", {"prompt": "x"}), ("/infill", {"input_prefix": "", "input_suffix": ""})):
            assert httpx.post(srv.url + path, json=body).status_code == 401
        assert httpx.get(srv.url + "/props").status_code == 401
        r = httpx.post(srv.url + "/completion", json={"prompt": "x"}, headers={"Authorization": "Bearer sk-test"})
        assert r.json()["content"] == "ok"
    finally:
        srv.stop()
