"""`tqserve run-batch` (vLLM's run_batch over OpenAI's Batch API format): a
JSONL file of chat, completion and embedding requests runs in one process,
the results come back in input order with the offline engine's greedy text
and the embedding /v1/embeddings gives, and lines that cannot run get their
error while the others run."""
import json
import subprocess
import sys

from engine import LLM, SamplingParams
from tests.test_server_process import REPO

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "1, 2, 3, 4,", "Water boils at",
           "The moon is", "My favourite colour is", "import numpy as"]


def test_run_batch_file(tmp_path):
    lines = [{"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "smollm2-135m", "prompt": p, "max_tokens": 6, "temperature": 0}}
             for i, p in enumerate(PROMPTS)]
    lines += [{"custom_id": "chat", "url": "/v1/chat/completions",
               "body": {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}},
              {"custom_id": "emb", "url": "/v1/embeddings", "body": {"input": "hello", "encoding_format": "float"}},
              {"custom_id": "bad-body", "url": "/v1/completions", "body": {"model": "smollm2-135m", "prompt": "x",
                                                                          "max_tokens": -1}},
              {"custom_id": "bad-url", "url": "/v1/files", "body": {}},
              {"custom_id": "streamed", "url": "/v1/completions", "body": {"prompt": "x", "stream": True}}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines) + "not json\n")
    out = tmp_path / "out.jsonl"
    r = subprocess.run([sys.executable, "-m", "server.cli", "run-batch", "-i", str(src), "-o", str(out),
                        "--dtype", "float32", "--kv-cache-memory", "128MiB"], cwd=REPO, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "14 requests in" in r.stderr and "10 succeeded, 4 failed" in r.stderr
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in results] == [x["custom_id"] for x in lines] + [None]
    llm = LLM("smollm2-135m", dtype="float32", kv_cache_memory=128 << 20)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))]
    got = [x["response"]["body"]["choices"][0]["text"] for x in results[:len(PROMPTS)]]
    assert got == want
    assert all(x["response"]["status_code"] == 200 and x["error"] is None for x in results[:10])
    assert results[8]["response"]["body"]["object"] == "chat.completion"
    emb = results[9]["response"]["body"]["data"][0]["embedding"]
    assert len(emb) == 576 and abs(sum(v * v for v in emb) - 1) < 1e-4
    errors = {x["custom_id"]: x for x in results[10:]}
    assert errors["bad-body"]["response"]["status_code"] == 400 and "max_tokens" in errors["bad-body"]["error"][
        "message"]
    assert "url must be one of" in errors["bad-url"]["error"]["message"]
    assert "stream is not supported" in errors["streamed"]["error"]["message"]
    assert "not valid JSON" in errors[None]["error"]["message"]
    assert all(x["response"]["body"] is None for x in results[10:])
