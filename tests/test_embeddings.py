"""Embeddings: pooled final hidden states (last token, mean, first), checked
against transformers' last_hidden_state; chunked prefill, preemption and
prefix caching; the pooling read from a model's files; POST /v1/embeddings
through the openai client (the stand-in engine; the real SmolLM2 server is in
test_server_openai.py)."""
import base64
import json
import struct

import numpy as np
import openai
import pytest
import torch

from engine import LLM, EngineArgs, InvalidRequest, PoolingError, PoolingParams, SamplingParams
from model_zoo import pooler_config
from model_zoo.resolve import open_model
from tests.fixtures_models import write_tiny_gguf
from tests.test_server_fake_engine import EMBED_DIM, FakeAsyncLLM, LiveServer, fake_embedding
from tests.tiny_models import save_tiny_qwen3, token_prompts

ST_MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
              {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
              {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]


def write_st(folder, mode: str = "lasttoken", normalize: bool = True) -> None:
    """A sentence-transformers layout, as Qwen3-Embedding ships it."""
    modules = ST_MODULES if normalize else ST_MODULES[:2]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    flags = {f"pooling_mode_{m}": m == mode for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **flags}))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_qwen3_embed")
    model = save_tiny_qwen3(d)
    write_st(d)
    return d, model


def reference(model, ids: list[int], pooling: PoolingParams) -> torch.Tensor:
    with torch.no_grad():
        h = model.model(torch.tensor([ids])).last_hidden_state[0].double()
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling.pooling_type]
    v = v[:pooling.dimensions] if pooling.dimensions else v
    return torch.nn.functional.normalize(v, dim=0) if pooling.normalize else v


def close(got: list[float], want: torch.Tensor) -> bool:
    return torch.allclose(torch.tensor(got, dtype=torch.float64), want, rtol=1e-4, atol=1e-5)


def test_pooled_states_equal_transformers(qwen3):
    d, model = qwen3
    # 16-token steps: the 40-70-token prompts pool over several chunks.
    llm = LLM(str(d), dtype="float32", kv_cache_memory=8 << 20, max_num_batched_tokens=16)
    assert llm.default_pooling == PoolingParams("last", normalize=True)     # from modules.json
    ps = token_prompts(5, 2, 70, seed=4) + [[7]]
    for pooling in (None, PoolingParams("mean", normalize=False), PoolingParams("cls", normalize=False),
                    PoolingParams("mean", dimensions=24), PoolingParams("last", normalize=False, dimensions=8)):
        outs = llm.embed(ps, pooling)
        for p, o in zip(ps, outs):
            assert o.prompt_token_ids == p
            assert close(o.outputs.embedding, reference(model, p, pooling or llm.default_pooling)), (pooling, len(p))
    one = llm.embed([5, 6, 7])          # one prompt of token ids, as LLM.generate takes it
    assert len(one) == 1 and close(one[0].outputs.embedding, reference(model, [5, 6, 7], llm.default_pooling))


def test_mixed_with_generation_preempted_and_cached(qwen3):
    d, model = qwen3
    ps = token_prompts(6, 30, 60, seed=5)
    mean = PoolingParams("mean")
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone = LLM(str(d), dtype="float32", kv_cache_memory=8 << 20)
    want_tokens = [o.outputs[0].token_ids for o in alone.generate(ps[:3], greedy)]
    # 2 layers x 2 x 2 KV heads x 32 dims x 4 B = 1 KiB/token: 200 tokens for 3 decodes + 3 embeddings.
    small = LLM(str(d), dtype="float32", kv_cache_memory=200 * 1024, block_size=4, max_num_batched_tokens=16,
                max_model_len=128)
    victims = []
    preempt = small.core.scheduler._preempt

    def record(req, out):
        victims.append((req.pooling is not None, req.num_computed_tokens))
        preempt(req, out)
    small.core.scheduler._preempt = record
    gen_ids = [small.add_request(p, greedy) for p in ps[:3]]
    emb_ids = [small.add_request(p, SamplingParams(max_tokens=0), pooling=mean) for p in ps[3:]]
    done = small._run(gen_ids + emb_ids, False)
    assert any(is_emb and computed > 0 for is_emb, computed in victims), victims   # a half-pooled one started over
    assert [done[r].outputs[0].token_ids for r in gen_ids] == want_tokens
    for r, p in zip(emb_ids, ps[3:]):
        assert done[r].finished and done[r].outputs[0].token_ids == []
        assert close(done[r].embedding, reference(model, p, mean))
    assert small.core.kv.num_used_blocks == 0
    # Prefix caching: a mean pool computes every position again; the last token's reuses the prefix.
    small.embed(ps[3], mean)
    hits = small.core.get_stats().prefix_cache_hits_total
    again = small.embed(ps[3], mean)[0]
    assert small.core.get_stats().prefix_cache_hits_total == hits and close(again.outputs.embedding,
                                                                            reference(model, ps[3], mean))
    last = PoolingParams("last")
    small.embed(ps[4], last)
    hits = small.core.get_stats().prefix_cache_hits_total
    again = small.embed(ps[4], last)[0]
    assert small.core.get_stats().prefix_cache_hits_total > hits
    assert close(again.outputs.embedding, reference(model, ps[4], last))


def test_bad_pooling_requests(qwen3):
    d, _ = qwen3
    llm = LLM(str(d), dtype="float32", kv_cache_memory=8 << 20)
    with pytest.raises(InvalidRequest, match="dimensions must be at most the model's 64, got 65"):
        llm.embed([[1, 2, 3]], PoolingParams(dimensions=65))
    with pytest.raises(InvalidRequest, match="give it max_tokens 0"):
        llm.add_request([1, 2], SamplingParams(max_tokens=3), pooling=PoolingParams())
    assert not llm.core.has_work()
    for kw, words in ((dict(pooling_type="max"), "pooling_type must be one of last, mean, cls"),
                      (dict(dimensions=0), "dimensions must be a positive integer"),
                      (dict(normalize="yes"), "normalize must be true or false")):
        with pytest.raises(PoolingError, match=words):
            PoolingParams(**kw)


def test_pooling_from_the_model_files(tmp_path):
    assert pooler_config.from_hf_folder(tmp_path) == {}
    write_st(tmp_path, "mean_tokens", normalize=False)
    assert pooler_config.from_hf_folder(tmp_path) == {"pooling_type": "mean", "normalize": False}
    write_st(tmp_path, "cls_token")
    assert pooler_config.from_hf_folder(tmp_path) == {"pooling_type": "cls", "normalize": True}
    write_st(tmp_path, "max_tokens")
    with pytest.raises(pooler_config.PoolerConfigError, match="pooling_mode_max_tokens is not supported"):
        pooler_config.from_hf_folder(tmp_path)
    (tmp_path / "modules.json").write_text("{")
    with pytest.raises(pooler_config.PoolerConfigError, match="modules.json: not a readable JSON file"):
        pooler_config.from_hf_folder(tmp_path)
    for t, want in ((1, {"pooling_type": "mean", "normalize": True}), (2, {"pooling_type": "cls", "normalize": True}),
                    (3, {"pooling_type": "last", "normalize": True}), (0, {}), (4, {})):
        assert pooler_config.from_gguf({"llama.pooling_type": t}, "llama") == want
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path)
    assert open_model(path, weights=False).pooler_config == {}


def test_pooler_config_flag():
    model = type("Source", (), {"pooler_config": {"pooling_type": "mean", "normalize": False}})()
    assert EngineArgs().pooling_defaults(None) == PoolingParams("last", True)
    assert EngineArgs().pooling_defaults(model) == PoolingParams("mean", False)
    assert EngineArgs(pooler_config={"pooling_type": "CLS"}).pooling_defaults(model) == PoolingParams("cls", False)
    for bad, words in (({"pooling": "mean"}, "unknown key 'pooling'"), ({"pooling_type": "max"}, "pooling_type"),
                       ({"pooling_type": 1}, "pooling_type must be a string"), ({"normalize": 1}, "normalize")):
        with pytest.raises(ValueError, match=words):
            EngineArgs(pooler_config=bad).validate()


@pytest.fixture()
def fake_server():
    srv = LiveServer(FakeAsyncLLM(max_model_len=64))
    yield srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    srv.stop()


def test_http_shape_and_parameters(fake_server):
    srv, client = fake_server
    tok = srv.llm.tokenizer
    r = client.embeddings.create(model="fake", input=["hello", "a b"], encoding_format="float")
    assert [d.index for d in r.data] == [0, 1] and r.model == "fake" and r.object == "list"
    for d, ids in zip(r.data, [tok.encode("hello"), tok.encode("a b")]):
        assert d.embedding == pytest.approx(fake_embedding(ids, PoolingParams()))
    assert r.usage.prompt_tokens == r.usage.total_tokens == len(tok.encode("hello")) + len(tok.encode("a b"))
    ids = client.embeddings.create(model="fake", input=[[5, 6, 7], [9]], encoding_format="float")
    assert [d.embedding for d in ids.data] == [pytest.approx(fake_embedding(p, PoolingParams())) for p in ([5, 6, 7], [9])]
    # The openai client asks for base64 by default and decodes it: the same floats (float32).
    b = client.embeddings.create(model="fake", input="hello")
    assert b.data[0].embedding == pytest.approx(r.data[0].embedding, rel=1e-6)
    raw = client.embeddings.create(model="fake", input="hello", encoding_format="base64").data[0].embedding
    assert list(struct.unpack(f"<{EMBED_DIM}f", base64.b64decode(raw))) == pytest.approx(r.data[0].embedding)
    cut = client.embeddings.create(model="fake", input="hello", dimensions=3, encoding_format="float")
    assert cut.data[0].embedding == pytest.approx(fake_embedding(tok.encode("hello"), PoolingParams(dimensions=3)))
    assert np.linalg.norm(cut.data[0].embedding) == pytest.approx(1)
    client.embeddings.create(model="fake", input="hello", extra_body={"normalize": False, "truncate_prompt_tokens": 2})
    assert srv.llm.poolings[-1] == PoolingParams("last", normalize=False) and srv.llm.prompts[-1] == \
        tok.encode("hello")[-2:]
    assert all(p.max_tokens == 0 for p in srv.llm.params)


def test_http_chat_form(fake_server):
    """vLLM's chat form: `messages` rendered by the chat template (no
    generation prompt unless asked), embedded as one input."""
    import httpx
    srv, _ = fake_server
    msgs = [{"role": "system", "content": "Embed this."}, {"role": "user", "content": "hello there"}]
    for gen_prompt in (False, True):
        want = httpx.post(srv.url + "/tokenize", json={"messages": msgs, "add_generation_prompt": gen_prompt}).json()
        r = httpx.post(srv.url + "/v1/embeddings", json={"model": "fake", "messages": msgs, "encoding_format": "float",
                                                         "add_generation_prompt": gen_prompt}).json()
        assert srv.llm.prompts[-1] == want["tokens"] and r["usage"]["prompt_tokens"] == want["count"]
        assert r["data"][0]["embedding"] == pytest.approx(fake_embedding(want["tokens"], PoolingParams()))
    assert srv.llm.prompts[-1] != srv.llm.prompts[-2]


def test_pooling_invocations_ping(fake_server):
    """vLLM's POST /pooling (an embedding model's task is embed), SageMaker's
    /invocations (the body's fields pick chat, completions, embeddings) and
    /ping; /server_info is a development route."""
    import httpx
    srv, _ = fake_server
    tok = srv.llm.tokenizer
    r = httpx.post(srv.url + "/pooling", json={"model": "fake", "input": ["hello", "a b"]}).json()
    assert r["id"].startswith("pool-") and [d["object"] for d in r["data"]] == ["pooling"] * 2
    assert r["data"][0]["data"] == pytest.approx(fake_embedding(tok.encode("hello"), PoolingParams()))
    assert r["data"][1]["data"] == pytest.approx(fake_embedding(tok.encode("a b"), PoolingParams()))
    bad = httpx.post(srv.url + "/pooling", json={"input": "hello", "task": "classify"})
    assert bad.status_code == 400 and "classifier" in bad.json()["error"]["message"]
    inv = srv.url + "/invocations"
    r = httpx.post(inv, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).json()
    assert r["object"] == "chat.completion" and len(r["choices"][0]["message"]["content"]) == 3
    r = httpx.post(inv, json={"prompt": "hi", "max_tokens": 2}).json()
    assert r["object"] == "text_completion" and len(r["choices"][0]["text"]) == 2
    r = httpx.post(inv, json={"input": "hello", "encoding_format": "float"}).json()
    assert r["data"][0]["embedding"] == pytest.approx(fake_embedding(tok.encode("hello"), PoolingParams()))
    r = httpx.post(inv, json={"nothing": 1})
    assert r.status_code == 400 and "messages (chat)" in r.json()["error"]["message"]
    r = httpx.post(inv, json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    assert httpx.get(srv.url + "/ping").status_code == 200 and httpx.post(srv.url + "/ping").status_code == 200
    assert httpx.get(srv.url + "/server_info").status_code == 404


@pytest.mark.parametrize("body, status, words", [
    ({"input": []}, 400, "input must not be empty"),
    ({"input": ["a", ""]}, 400, "must not contain empty"),
    ({"input": [[1], []]}, 400, "must not contain empty"),
    ({"input": "a", "dimensions": 0}, 400, "dimensions"),
    ({"input": "a", "dimensions": EMBED_DIM + 1}, 400, f"at most the model's {EMBED_DIM}"),
    ({"input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x" * 80}, 400, "maximum context length is 64 tokens"),
    ({"input": [[99999]]}, 400, "out of vocabulary"),
    ({"input": "a", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({"input": ["a"] * 2049}, 400, "at most 2048"),
    ({"input": "a", "model": "other"}, 404, "does not exist"),
    ({"inputs": "a"}, 400, "input"),
    ({"input": "a", "messages": [{"role": "user", "content": "x"}]}, 400, "exactly one of input or messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x" * 80}]}, 400, "maximum context length is 64 tokens"),
])
def test_http_bad_requests(fake_server, body, status, words):
    srv, _ = fake_server
    import httpx
    n = len(srv.llm.params)
    r = httpx.post(srv.url + "/v1/embeddings", json=body, timeout=10)
    assert r.status_code == status and words in r.json()["error"]["message"], r.text
    assert r.json()["error"]["type"] in ("invalid_request_error", "NotFoundError", "not_found_error")
    assert len(srv.llm.params) <= n + 1 and not srv.llm.running and not srv.llm.waiting


@pytest.mark.parametrize("tied", [False, True])
def test_backbone_only_checkpoints(tmp_path, tied):
    """As Qwen3-Embedding ships: the bare backbone's names (embed_tokens.weight,
    layers.N..., norm.weight), the 0.6B tied, the 8B untied and headless."""
    from transformers import Qwen3Config, Qwen3Model
    torch.manual_seed(1)
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      tie_word_embeddings=tied, architectures=["Qwen3ForCausalLM"])
    backbone = Qwen3Model(cfg).float()
    backbone.save_pretrained(tmp_path, safe_serialization=True)
    write_st(tmp_path)
    source = open_model(tmp_path, weights=True)
    assert source.generates == tied and source.config["tie_word_embeddings"]
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=8 << 20)
    ps = token_prompts(3, 3, 40, seed=6)
    model = type("M", (), {"model": backbone})()
    for p, o in zip(ps, llm.embed(ps)):
        assert close(o.outputs.embedding, reference(model, p, PoolingParams()))
    if tied:
        assert len(llm.generate([ps[0]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3
    else:
        with pytest.raises(InvalidRequest, match="embeddings only"):
            llm.generate([ps[0]], SamplingParams(max_tokens=3))
        assert not llm.core.has_work()


def cosine(a: list[float], b: list[float]) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_score_and_rerank(fake_server):
    srv, client = fake_server
    import httpx
    tok = srv.llm.tokenizer
    emb = {t: fake_embedding(tok.encode(t), PoolingParams()) for t in ("q", "apple pie", "pear", "stone")}
    r = httpx.post(srv.url + "/v1/score", json={"model": "fake", "text_1": "q", "text_2": ["apple pie", "pear"]})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "list" and body["id"].startswith("score-")
    assert [d["score"] for d in body["data"]] == pytest.approx([cosine(emb["q"], emb["apple pie"]),
                                                                cosine(emb["q"], emb["pear"])])
    # Each distinct text is embedded once: q, apple pie, pear.
    assert body["usage"]["prompt_tokens"] == sum(len(tok.encode(t)) for t in ("q", "apple pie", "pear"))
    pairwise = httpx.post(srv.url + "/score", json={"text_1": ["pear", "stone"], "text_2": ["stone", "pear"]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx([cosine(emb["pear"], emb["stone"])] * 2)
    docs = ["apple pie", {"text": "pear"}, "stone"]
    want = sorted(((cosine(emb["q"], emb[t]), i) for i, t in enumerate(["apple pie", "pear", "stone"])), reverse=True)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        res = httpx.post(srv.url + path, json={"query": "q", "documents": docs, "top_n": 2}).json()
        assert [x["index"] for x in res["results"]] == [i for _, i in want[:2]]
        assert [x["relevance_score"] for x in res["results"]] == pytest.approx([s for s, _ in want[:2]])
        assert res["results"][0]["document"]["text"] == ["apple pie", "pear", "stone"][want[0][1]]
    bare = httpx.post(srv.url + "/v1/rerank", json={"query": "q", "documents": docs, "return_documents": False})
    assert len(bare.json()["results"]) == 3 and "document" not in bare.json()["results"][0]
    for path, body, words in (("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "give one text_1"),
                              ("/v1/score", {"text_1": "a", "text_2": []}, "non-empty"),
                              ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
                              ("/v1/rerank", {"query": "", "documents": ["a"]}, "query"),
                              ("/v1/rerank", {"query": "q", "documents": ["a", ""]}, "must not be empty"),
                              ("/v1/rerank", {"query": "q", "documents": ["a"], "model": "x"}, "does not exist")):
        r = httpx.post(srv.url + path, json=body)
        assert r.status_code in (400, 404) and words in r.json()["error"]["message"], (path, body, r.text)


def test_score_routes_need_the_key():
    import httpx
    srv = LiveServer(FakeAsyncLLM(), api_keys=["k"])
    try:
        for path in ("/v1/score", "/score", "/rerank", "/v2/rerank"):
            body = {"text_1": "a", "text_2": "b"} if "score" in path else {"query": "a", "documents": ["b"]}
            assert httpx.post(srv.url + path, json=body).status_code == 401
            assert httpx.post(srv.url + path, json=body, headers={"Authorization": "Bearer k"}).status_code == 200
    finally:
        srv.stop()


@pytest.mark.parametrize("kw", [dict(async_scheduling=True),
                                dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3})])
def test_with_async_scheduling_and_drafts(qwen3, kw):
    d, model = qwen3
    ps = token_prompts(6, 3, 60, seed=9)
    llm = LLM(str(d), dtype="float32", kv_cache_memory=8 << 20, max_num_batched_tokens=16, **kw)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(d), dtype="float32", kv_cache_memory=8 << 20).generate(
        ps[:3], greedy)]
    mean = PoolingParams("mean", normalize=False)
    gen = [llm.add_request(p, greedy) for p in ps[:3]]
    emb = [llm.add_request(p, SamplingParams(max_tokens=0), pooling=mean) for p in ps[3:]]
    done = llm._run(gen + emb, False)
    assert [done[r].outputs[0].token_ids for r in gen] == want
    for r, p in zip(emb, ps[3:]):
        assert close(done[r].embedding, reference(model, p, mean))
