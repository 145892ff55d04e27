"""Fill-in-the-middle: /v1/completions with `suffix` on a model whose
vocabulary has FIM tokens (a tiny llama with SmolLM2's tokenizer and
Qwen2.5-Coder's three FIM tokens added) runs the prefix-suffix-middle
prompt, and its greedy middle equals transformers' on the same ids; the
tokens are found by name for each family; a model without them is a 400
(test_server_openai.py::test_errors_400)."""
import httpx
import openai
import pytest
import torch

from model_zoo.fim import FIM_NAMES, fim_prompt, fim_token_ids
from tests.fixtures_models import hf_tokenizer
from tests.test_server_process import ServerProcess

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    d = tmp_path_factory.mktemp("coder")
    tok = hf_tokenizer("smollm2-135m")
    tok.add_special_tokens({"additional_special_tokens": FIM})
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                                         tie_word_embeddings=True)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d, model, tok


class _Vocab:
    def __init__(self, names):
        self.ids = {n: 100 + i for i, n in enumerate(names)}

    def convert_tokens_to_ids(self, name):
        return self.ids.get(name)


def test_fim_tokens_by_family():
    for names in FIM_NAMES:
        assert fim_token_ids(_Vocab(names)) == (100, 101, 102)
    assert fim_token_ids(_Vocab(["<fim_prefix>", "<fim_suffix>"])) is None      # a partial set is none
    assert fim_token_ids(None) is None


def test_suffix_fills_the_middle(coder, tmp_path):
    path, model, tok = coder
    prefix, suffix = "def add(a, b):\n    c = ", "\n    return c\n"
    pre, suf, mid = tok.convert_tokens_to_ids(FIM)
    want_prompt = [pre] + tok.encode(prefix, add_special_tokens=False) + [suf] + \
        tok.encode(suffix, add_special_tokens=False) + [mid]
    with torch.no_grad():
        gen = model.generate(torch.tensor([want_prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(want_prompt):].tolist()
    srv = ServerProcess(tmp_path / "server.log", "--model", str(path), "--dtype", "float32",
                        "--kv-cache-memory", "16MiB")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = client.completions.create(model=str(path), prompt=prefix, suffix=suffix, max_tokens=8, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True}).model_dump()
        c = r["choices"][0]
        assert c["prompt_token_ids"] == want_prompt and c["token_ids"] == gen
        assert c["text"] == tok.decode(gen, skip_special_tokens=True)
        streamed = "".join(ch.choices[0].text for ch in client.completions.create(
            model=str(path), prompt=prefix, suffix=suffix, max_tokens=8, temperature=0, stream=True,
            extra_body={"ignore_eos": True}))
        assert streamed == c["text"]
        bad = httpx.post(srv.url + "/v1/completions", json={"prompt": prefix, "suffix": suffix, "echo": True})
        assert bad.status_code == 400 and "echo" in bad.json()["error"]["message"]
    finally:
        srv.stop()


def test_fim_prompt_layout(coder):
    from model_zoo.tokenizer import Tokenizer
    path, _, tok = coder
    ours = Tokenizer.from_file(path / "tokenizer.json", {})
    ids = fim_token_ids(ours)
    assert ids == tuple(tok.convert_tokens_to_ids(FIM))
    assert fim_prompt(ours, ids, [5, 6], "x") == [ids[0], 5, 6, ids[1]] + tok.encode("x", add_special_tokens=False) \
        + [ids[2]]
