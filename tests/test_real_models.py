"""End-to-end on the two real GGUF models: logits and greedy generation
through the engine against transformers (fp32, loading the same GGUF)."""
import pytest
import torch

from engine import LLM, SamplingParams
from fixtures_models import hf_gguf_model, shakespeare_text

MODELS = ["smollm2-135m", "gemma3-270m"]


def shakespeare_ids(tok, n, offset=0):
    text = shakespeare_text()
    return tok.encode(text[offset:offset + 20 * n], add_special_tokens=False)[:n]


@pytest.fixture(scope="module", params=MODELS)
def pair(request):
    hf = hf_gguf_model(request.param)
    hf.eval()
    hf.generation_config.eos_token_id = None     # both sides run exactly max_tokens (ignore_eos)
    llm = LLM(request.param, kv_cache_memory=256 << 20, max_model_len=2048, dtype="float32", quantization="none")
    return request.param, hf, llm


def test_logit_parity_64_tokens(pair):
    name, hf, llm = pair
    tok = llm.tokenizer
    ids = [tok.bos_token_id] + shakespeare_ids(tok, 63, 1000) if tok.bos_token_id is not None \
        else shakespeare_ids(tok, 64, 1000)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
        model = llm.core.model
        t = torch.tensor(ids)
        ours = model.compute_logits(model(t, torch.arange(len(ids)), None))
    diff = (ours - ref).abs().max().item()
    print(f"{name}: max |logit diff| over 64 positions = {diff:.2e}")
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert diff < 2e-3 * ref.abs().max().item()


def test_greedy_generation_equals_transformers(pair):
    name, hf, llm = pair
    tok = llm.tokenizer
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "Write a haiku about the sea."}]]
    from model_zoo.chat_template import render_chat
    prompts = [tok.encode(render_chat(llm.chat_template, c, bos_token=tok.bos_token, eos_token=tok.eos_token),
                          add_special_tokens=False) for c in chats]
    prompts.append(shakespeare_ids(tok, 100, 5000))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=32, do_sample=False)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref, name


def test_batch_invariance_among_15_others(pair):
    name, hf, llm = pair
    tok = llm.tokenizer
    target = shakespeare_ids(tok, 80, 20000)
    others = [shakespeare_ids(tok, 20 + 17 * i, 30000 + 3000 * i) for i in range(15)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate([target], sp)[0].outputs[0].token_ids
    mixed = llm.generate(others[:7] + [target] + others[7:], sp)
    assert mixed[7].outputs[0].token_ids == alone
