"""Fill-in-the-middle: /v1/completions with `suffix` and llama.cpp's /infill
on a model whose vocabulary has FIM tokens (a tiny llama with SmolLM2's
tokenizer and Qwen2.5-Coder's FIM and repository tokens added) run the
prefix-suffix-middle prompt (/infill: after the project's other files), and
the greedy middle equals transformers' on the same ids; llama.cpp's
/completion gives transformers' tokens and top logprobs; the tokens are found
by name for each family; a model without them is a 400
(test_server_openai.py::test_errors_400, test_llamacpp_api.py)."""
import json

import httpx
import openai
import pytest
import torch

from model_zoo.fim import FIM_NAMES, REPO_NAMES, SNIPPET_SEPARATOR, fim_prompt, fim_token_ids, infill_prompt
from tests.fixtures_models import hf_tokenizer
from tests.test_server_process import ServerProcess

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
REPO = ["<|repo_name|>", "<|file_sep|>"]


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    d = tmp_path_factory.mktemp("coder")
    tok = hf_tokenizer("smollm2-135m")
    tok.add_special_tokens({"additional_special_tokens": FIM + REPO})
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                                         tie_word_embeddings=True)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d, model, tok


@pytest.fixture(scope="module")
def server(coder, tmp_path_factory):
    path, _, _ = coder
    srv = ServerProcess(tmp_path_factory.mktemp("coder-server") / "server.log", "--model", str(path),
                        "--dtype", "float32", "--kv-cache-memory", "16MiB")
    yield srv
    srv.stop()


def _greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(ids):].tolist()


class _Vocab:
    """Named tokens at 100, 101, ...; text one id per character (1000 + its code)."""
    def __init__(self, names):
        self.ids = {n: 100 + i for i, n in enumerate(names)}

    def convert_tokens_to_ids(self, name):
        return self.ids.get(name)

    def encode(self, text, add_special_tokens=True):
        return [1000 + ord(c) for c in text]


def _text(s):
    return [1000 + ord(c) for c in s]


def test_fim_tokens_by_family():
    for names in FIM_NAMES:
        assert fim_token_ids(_Vocab(names)) == (100, 101, 102)
    assert fim_token_ids(_Vocab(["<fim_prefix>", "<fim_suffix>"])) is None      # a partial set is none
    assert fim_token_ids(None) is None


def test_suffix_fills_the_middle(coder, server):
    path, model, tok = coder
    prefix, suffix = "def add(a, b):\n    c = ", "\n    return c\n"
    pre, suf, mid = tok.convert_tokens_to_ids(FIM)
    want_prompt = [pre] + tok.encode(prefix, add_special_tokens=False) + [suf] + \
        tok.encode(suffix, add_special_tokens=False) + [mid]
    gen = _greedy(model, want_prompt, 8)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    r = client.completions.create(model=str(path), prompt=prefix, suffix=suffix, max_tokens=8, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True}).model_dump()
    c = r["choices"][0]
    assert c["prompt_token_ids"] == want_prompt and c["token_ids"] == gen
    assert c["text"] == tok.decode(gen, skip_special_tokens=True)
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=str(path), prompt=prefix, suffix=suffix, max_tokens=8, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == c["text"]
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": prefix, "suffix": suffix, "echo": True})
    assert bad.status_code == 400 and "echo" in bad.json()["error"]["message"]


def test_infill_lays_out_the_project_as_llama_cpp(coder, server):
    """/infill: the other files after the repository tokens, the current line
    (`prompt`) after the prefix; greedy tokens equal transformers' on those ids."""
    _, model, tok = coder
    enc = lambda s: tok.encode(s, add_special_tokens=False)      # noqa: E731
    pre, suf, mid = tok.convert_tokens_to_ids(FIM)
    repo, sep = tok.convert_tokens_to_ids(REPO)
    extra = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]
    body = {"input_prefix": "def add(a, b):\n", "prompt": "    c = ", "input_suffix": "\n    return c\n",
            "input_extra": extra, "n_predict": 8, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    want = [repo] + enc("myproject\n") + [sep] + enc("util.py\n") + enc(extra[0]["text"]) + [sep] + \
        enc("filename\n") + [pre] + enc(body["input_prefix"]) + enc(body["prompt"]) + [suf] + \
        enc(body["input_suffix"]) + [mid]
    gen = _greedy(model, want, 8)
    r = httpx.post(server.url + "/infill", json=body, timeout=60).json()
    assert r["tokens"] == gen and r["tokens_evaluated"] == len(want)
    assert r["content"] == tok.decode(gen, skip_special_tokens=True) and r["stop_type"] == "limit"
    with httpx.stream("POST", server.url + "/infill", json={**body, "stream": True}, timeout=60) as s:
        events = [json.loads(b[6:]) for b in s.read().decode().split("\n\n") if b]
    assert "".join(e["content"] for e in events) == r["content"] and events[-1]["stop"] is True


def test_llama_completion_tokens_and_logprobs(coder, server):
    """llama.cpp's /completion: transformers' greedy tokens and, with n_probs,
    its top log-probabilities of each step."""
    _, model, tok = coder
    prompt = "def mul(a, b):\n    return"
    ids = tok.encode(prompt)
    gen = _greedy(model, ids, 6)
    r = httpx.post(server.url + "/completion", json={"prompt": prompt, "n_predict": 6, "temperature": 0,
                                                     "ignore_eos": True, "return_tokens": True, "n_probs": 3},
                   timeout=60).json()
    assert r["tokens"] == gen
    with torch.no_grad():
        logits = model(torch.tensor([ids + gen])).logits[0, len(ids) - 1:-1].log_softmax(-1)
    for step, probs in zip(logits, r["completion_probabilities"]):
        want = step.topk(3)
        assert [e["id"] for e in probs["top_logprobs"]] == want.indices.tolist()
        assert [e["logprob"] for e in probs["top_logprobs"]] == pytest.approx(want.values.tolist(), abs=1e-4)
    assert httpx.get(server.url + "/props").json()["infill"] is True


def test_infill_prompt_layout_and_cuts():
    """llama.cpp's budget: the prefix keeps its last 3/4 of the batch, the
    suffix its first 1/4 less the line and two, the other files their last
    tokens that leave the batch and 2 x n_predict free; snippet separators
    without repository tokens."""
    fim = _Vocab(FIM_NAMES[0])
    ids = fim_token_ids(fim)
    got = infill_prompt(fim, ids, "p" * 100, "s" * 100, "l" * 3, [("f.py", "x" * 50)], n_batch=40,
                        n_predict=5, n_ctx=60)
    context = _text(SNIPPET_SEPARATOR) + _text("x" * 50)
    keep = 60 - 40 - 10
    assert got == context[-keep:] + [ids[0]] + _text("p" * 30) + _text("lll") + [ids[1]] + _text("s" * 5) + [ids[2]]
    repo = _Vocab(FIM_NAMES[0] + REPO_NAMES[0])
    r, s = repo.ids[REPO_NAMES[0][0]], repo.ids[REPO_NAMES[0][1]]
    got = infill_prompt(repo, fim_token_ids(repo), "a", "b", "", [("f.py", "x")], n_ctx=4096, n_batch=2048)
    assert got == [r] + _text("myproject\n") + [s] + _text("f.py\n") + _text("x") + [s] + _text("filename\n") + \
        [ids[0]] + _text("a") + [ids[1]] + _text("b") + [ids[2]]


def test_fim_prompt_layout(coder):
    from model_zoo.tokenizer import Tokenizer
    path, _, tok = coder
    ours = Tokenizer.from_file(path / "tokenizer.json", {})
    ids = fim_token_ids(ours)
    assert ids == tuple(tok.convert_tokens_to_ids(FIM))
    assert fim_prompt(ours, ids, [5, 6], "x") == [ids[0], 5, 6, ids[1]] + tok.encode("x", add_special_tokens=False) \
        + [ids[2]]
