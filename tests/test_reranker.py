"""Yes/no-token rerankers served the way vLLM serves Qwen3-Reranker
(--hf-overrides with classifier_from_token ["no", "yes"]): a pair's score
is P("yes") among the two tokens at the last position of text_1's tokens
followed by text_2's. Checked against transformers (a tiny fp32 Qwen3 with
SmolLM2's tokenizer, sharpened so that scores spread) offline (LLM.score,
LLM.classify, beside generation) and over HTTP (/v1/score, /v1/rerank,
/classify on a live server)."""
import json

import httpx
import pytest
import torch

from engine import LLM, InvalidRequest, SamplingParams
from tests.fixtures_models import hf_tokenizer
from tests.test_server_process import ServerProcess

OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
             "is_original_qwen3_reranker": True}
QUERY = "<Query>: which animal barks?\n"
DOCS = ["<Document>: the dog barks at night", "<Document>: cats purr", "<Document>: stock prices rose",
        "<Document>: a loud bark came from the kennel"]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    d = tmp_path_factory.mktemp("reranker")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(d)
    tok = hf_tokenizer("smollm2-135m")
    tok.save_pretrained(d)
    return d, model, tok


def p_yes(model, tok, ids: list[int]) -> float:
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double()
    return torch.softmax(logits[[no, yes]], 0)[1].item()


def pair(tok, a: str, b: str) -> list[int]:
    return tok(a).input_ids + tok(b, add_special_tokens=False).input_ids


def test_scores_equal_transformers(reranker):
    path, model, tok = reranker
    llm = LLM(str(path), dtype="float32", kv_cache_memory=16 << 20, hf_overrides=OVERRIDES)
    assert llm.core.info.classifier_labels == ["no", "yes"]
    want = [p_yes(model, tok, pair(tok, QUERY, d)) for d in DOCS]
    assert max(want) - min(want) > 0.05          # the scores tell the documents apart
    # Scored while generation requests run in the same steps.
    rid = llm.add_request("The dog", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    got = llm.score(QUERY, DOCS)
    assert [o.outputs.score for o in got] == pytest.approx(want, abs=1e-5)
    assert got[0].prompt_token_ids == pair(tok, QUERY, DOCS[0])
    pairwise = llm.score([QUERY, DOCS[0]], [DOCS[1], DOCS[2]])
    assert pairwise[1].outputs.score == pytest.approx(p_yes(model, tok, pair(tok, DOCS[0], DOCS[2])), abs=1e-5)
    while llm.core.has_work():
        llm.step()
    assert rid not in llm.core.scheduler.requests
    probs = llm.classify(["is this a question?", [5, 6, 7]])
    for o, ids in zip(probs, (tok("is this a question?").input_ids, [5, 6, 7])):
        assert sum(o.outputs.probs) == pytest.approx(1) and len(o.outputs.probs) == 2
        assert o.outputs.probs[1] == pytest.approx(p_yes(model, tok, ids), abs=1e-5)
    with pytest.raises(InvalidRequest, match="one per data_2"):
        llm.score([QUERY, QUERY], DOCS)


@pytest.mark.parametrize("num_labels", [1, 3])
def test_score_head_checkpoints_equal_transformers(reranker, tmp_path, num_labels):
    """A ForSequenceClassification checkpoint (a trained score head, no LM
    head): classify gives softmax (one label: sigmoid) of its logits at the
    last token, score the last label's, as transformers computes them."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification
    _, _, tok = reranker
    torch.manual_seed(1)
    cfg = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      num_labels=num_labels, pad_token_id=0, tie_word_embeddings=True)
    model = Qwen3ForSequenceClassification(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=16 << 20)
    assert llm.core.info.classifier_labels == [f"LABEL_{i}" for i in range(num_labels)]

    def want(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].double()
        return (torch.sigmoid(logits) if num_labels == 1 else torch.softmax(logits, 0)).tolist()
    texts = ["is this a question?", "the dog barks"]
    for o, text in zip(llm.classify(texts), texts):
        assert o.outputs.probs == pytest.approx(want(tok(text).input_ids), abs=1e-5)
    scores = [o.outputs.score for o in llm.score(QUERY, DOCS[:2])]
    assert scores == pytest.approx([want(pair(tok, QUERY, d))[-1] for d in DOCS[:2]], abs=1e-5)
    assert len(set(round(x, 4) for x in scores)) == 2
    if num_labels == 1:         # the head is whole on every rank
        with LLM(str(tmp_path), dtype="float32", kv_cache_memory=16 << 20, tensor_parallel_size=2) as tp:
            assert [o.outputs.score for o in tp.score(QUERY, DOCS[:2])] == pytest.approx(scores, abs=1e-5)


def test_score_by_embeddings_without_a_classifier(reranker):
    """LLM.score on a plain model: the cosine of the texts' last-token states (vLLM's embedding scoring)."""
    path, model, tok = reranker
    plain = LLM(str(path), dtype="float32", kv_cache_memory=16 << 20)

    def unit(text):
        with torch.no_grad():
            h = model.model(torch.tensor([tok(text).input_ids])).last_hidden_state[0, -1].double()
        return h / h.norm()
    got = [o.outputs.score for o in plain.score(QUERY, DOCS[:3])]
    assert got == pytest.approx([float(unit(QUERY) @ unit(d)) for d in DOCS[:3]], abs=1e-5)


def test_bad_classifier_configs(reranker):
    path, _, _ = reranker
    with pytest.raises(ValueError, match="missing 1 tensor"):       # a score head the checkpoint lacks
        LLM(str(path), dtype="float32", kv_cache_memory=16 << 20,
            hf_overrides={"architectures": ["Qwen3ForSequenceClassification"]})
    with pytest.raises(ValueError, match="not a token of this model"):
        LLM(str(path), dtype="float32", kv_cache_memory=16 << 20,
            hf_overrides={"classifier_from_token": ["no", "yés!"]})
    plain = LLM(str(path), dtype="float32", kv_cache_memory=16 << 20)
    with pytest.raises(InvalidRequest, match="not a classifier"):
        plain.classify("x")


def test_http_score_rerank_classify(reranker, tmp_path):
    path, model, tok = reranker
    srv = ServerProcess(tmp_path / "server.log", "--model", str(path), "--dtype", "float32",
                        "--kv-cache-memory", "16MiB", "--hf-overrides", json.dumps(OVERRIDES))
    try:
        want = [p_yes(model, tok, pair(tok, QUERY, d)) for d in DOCS]
        r = httpx.post(srv.url + "/v1/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=60).json()
        assert [d["score"] for d in r["data"]] == pytest.approx(want, abs=1e-5)
        assert r["usage"]["prompt_tokens"] == sum(len(pair(tok, QUERY, d)) for d in DOCS)
        r = httpx.post(srv.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2}, timeout=60).json()
        best = sorted(range(len(DOCS)), key=lambda i: -want[i])[:2]
        assert [x["index"] for x in r["results"]] == best
        assert [x["relevance_score"] for x in r["results"]] == pytest.approx([want[i] for i in best], abs=1e-5)
        r = httpx.post(srv.url + "/classify", json={"input": ["is this a question?", "no"]}, timeout=60).json()
        for d, text in zip(r["data"], ("is this a question?", "no")):
            p = p_yes(model, tok, tok(text).input_ids)
            assert d["probs"] == pytest.approx([1 - p, p], abs=1e-5) and d["num_classes"] == 2
            assert d["label"] == ("yes" if p > 0.5 else "no")
        pooled = httpx.post(srv.url + "/pooling", json={"input": ["is this a question?", "no"]}, timeout=60).json()
        for got, want in zip(pooled["data"], r["data"]):       # a classifier's task (batched differently)
            assert got["data"] == pytest.approx(want["probs"], abs=1e-5)
        bad = httpx.post(srv.url + "/classify", json={"input": []}, timeout=60)
        assert bad.status_code == 400 and "input" in bad.json()["error"]["message"]
    finally:
        srv.stop()
    assert "a token classifier: labels ['no', 'yes']" in srv.log()


def test_tensor_parallel(reranker):
    """Two ranks (gloo): the classifier row's logits are a collective every rank runs."""
    path, model, tok = reranker
    with LLM(str(path), dtype="float32", kv_cache_memory=16 << 20, hf_overrides=OVERRIDES,
             tensor_parallel_size=2) as llm:
        got = [o.outputs.score for o in llm.score(QUERY, DOCS[:2])]
        text = llm.generate("The dog", SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids
    assert got == pytest.approx([p_yes(model, tok, pair(tok, QUERY, d)) for d in DOCS[:2]], abs=1e-5)
    ids = tok("The dog").input_ids
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids):].tolist()
    assert text == want             # the ranks stay in step after the classifier's collective
