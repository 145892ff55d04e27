"""Images through the engine: a tiny random Gemma3ForConditionalGeneration
(SigLIP tower + projector + Gemma 3 text, fp32) against transformers' model
on the same images: greedy tokens equal its generate(), prompt and output
logprobs within 1e-4, with an image's tokens attending to each other
(transformers' token_type_ids mask; the causal mask gives other logits, so
the check can fail). Chunked prefill never cuts an image, prefix caching
tells images apart, each image is encoded once, and bad inputs are refused
with a clear message."""
import numpy as np
import pytest
import torch
from PIL import Image

from engine import LLM, SamplingParams
from engine.errors import InvalidRequest

IMG, BOI, EOI = 250, 251, 252          # image, start-of-image and end-of-image token ids
N_IMG = 16                             # tokens per image: an 8 x 8 patch grid pooled 2 x 2
LOGPROB_TOL = 1e-4


def save_tiny_gemma3_vision(path, sliding_window=64):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig
    torch.manual_seed(3)
    text = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                            sliding_window=sliding_window, max_position_embeddings=1024, query_pre_attn_scalar=32,
                            bos_token_id=1, eos_token_id=2)
    vision = SiglipVisionConfig(image_size=32, patch_size=4, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=2)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=N_IMG,
                       image_token_index=IMG, boi_token_index=BOI, eoi_token_index=EOI,
                       bos_token_id=1, eos_token_id=2)
    m = Gemma3ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
            elif "mm_input_projection" in n:           # zeros at init
                p.copy_(torch.randn_like(p) * 0.5)
            elif "vision" not in n:
                p.mul_(4.0)
    m.save_pretrained(path, safe_serialization=True)
    return m


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3_vision")
    return str(d), save_tiny_gemma3_vision(d)


def image(seed: int, size=(37, 23)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def prompt_ids(*pieces) -> list[int]:
    """Text token lists and "img" markers -> ids with each image's run."""
    out = [1]
    for p in pieces:
        out += [BOI] + [IMG] * N_IMG + [EOI] if p == "img" else list(p)
    return out


def hf_pixels(images):
    from model_zoo.gemma3_vision import preprocess
    return torch.stack([preprocess(im, {"vision_config": {"image_size": 32}}) for im in images])


def hf_reference(hf, ids, images, max_tokens, bidirectional=True):
    """transformers' greedy tokens and the log-softmax over prompt + them."""
    x = torch.tensor([ids])
    kw = dict(pixel_values=hf_pixels(images)) if images else {}
    tt = (x == IMG).long()
    with torch.no_grad():
        got = hf.generate(x, attention_mask=torch.ones_like(x), token_type_ids=tt, max_new_tokens=max_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0, **kw)[0, len(ids):].tolist()
        full = torch.tensor([ids + got])
        logits = hf(full, token_type_ids=(full == IMG).long() if bidirectional else None, **kw).logits[0]
    return got, torch.log_softmax(logits.float(), -1)


def greedy(max_tokens=8, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def llm(path, **kw):
    return LLM(path, dtype="float32", quantization="none", block_size=4, **kw)


def gap(out, ids, ref) -> float:
    worst = 0.0
    for i in range(1, len(ids)):
        worst = max(worst, abs(out.prompt_logprobs[i][ids[i]] - ref[i - 1, ids[i]].item()))
    for j, t in enumerate(out.outputs[0].token_ids):
        worst = max(worst, abs(out.outputs[0].logprobs[j][t] - ref[len(ids) - 1 + j, t].item()))
    return worst


PROMPTS = [(prompt_ids([5, 6, 7], "img", [8, 9]), [0]),
           (prompt_ids([10], "img", [11, 12, 13], "img", [14]), [1, 2])]


def test_tokens_and_logprobs_equal_transformers(model):
    path, hf = model
    engine = llm(path)
    for ids, seeds in PROMPTS:
        images = [image(s) for s in seeds]
        out = engine.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}},
                              greedy(logprobs=1, prompt_logprobs=1))[0]
        ref_tokens, ref = hf_reference(hf, ids, images, 8)
        assert out.outputs[0].token_ids == ref_tokens
        worst = gap(out, ids, ref)
        print(f"max |logprob - transformers| = {worst:.2e}")
        assert worst < LOGPROB_TOL
        # The causal mask alone is measurably another model: the check can fail.
        _, causal = hf_reference(hf, ids, images, 8, bidirectional=False)
        assert gap(out, ids, causal) > 100 * LOGPROB_TOL


def test_chunks_never_cut_an_image_and_the_encoder_runs_once(model):
    path, _ = model
    ids, seeds = PROMPTS[1]
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": [image(s) for s in seeds]}}
    whole = llm(path).generate(prompt, greedy(logprobs=1))[0]
    engine = llm(path, max_num_batched_tokens=N_IMG + 3, enable_prefix_caching=False)
    sched = engine.core.scheduler
    chunks = []
    orig = sched.schedule

    def spy():
        out = orig()
        chunks.extend((s.start, s.start + s.num_new_tokens) for s in out.scheduled if s.num_new_tokens > 1)
        return out
    sched.schedule = spy
    out = engine.generate(prompt, greedy(logprobs=1))[0]
    assert out.outputs[0].token_ids == whole.outputs[0].token_ids
    for a, b in zip(out.outputs[0].logprobs, whole.outputs[0].logprobs):
        assert all(abs(a[t] - b[t]) < 1e-5 for t in a)
    spans = [(i, i + N_IMG) for i in range(len(ids)) if ids[i] == IMG and ids[i - 1] != IMG]
    assert len(chunks) >= 3
    for a, b in chunks:
        assert not any(s < b < e for s, e in spans), (chunks, spans)
    assert engine.core.runner.encoder_cache.encoded == 2


def test_prefix_cache_tells_images_apart(model):
    path, hf = model
    engine = llm(path)
    ids = prompt_ids([5, 6, 7], "img", [8, 9, 10, 11, 12])
    outs = {}
    for seed in (4, 4, 5):
        o = engine.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [image(seed)]}},
                            greedy(logprobs=1))[0]
        outs.setdefault(seed, []).append(o)
    first, again = outs[4]
    assert again.num_cached_tokens >= 20 and again.outputs[0].token_ids == first.outputs[0].token_ids
    other = outs[5][0]
    # Only the blocks before the image are shared with another image's prompt.
    assert other.num_cached_tokens <= 4
    assert other.outputs[0].token_ids == hf_reference(hf, ids, [image(5)], 8)[0]


def test_bad_image_inputs_are_refused(model, tmp_path):
    path, _ = model
    engine = llm(path, limit_mm_per_prompt={"image": 1})
    ids = prompt_ids([5], "img")
    with pytest.raises(InvalidRequest, match="1 image"):
        engine.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [image(0), image(1)]}}, greedy())
    with pytest.raises(InvalidRequest, match="at most 1 image"):
        engine.generate({"prompt_token_ids": prompt_ids("img", "img"),
                         "multi_modal_data": {"image": [image(0), image(1)]}}, greedy())
    with pytest.raises(InvalidRequest, match="images only"):
        engine.generate({"prompt_token_ids": ids, "multi_modal_data": {"audio": [b""]}}, greedy())
    small = llm(path, max_num_batched_tokens=8)
    with pytest.raises(InvalidRequest, match="max_num_batched_tokens"):
        small.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [image(0)]}}, greedy())
    from tiny_models import save_tiny_llama
    save_tiny_llama(tmp_path)
    with pytest.raises(InvalidRequest, match="no images"):
        llm(str(tmp_path)).generate({"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": [image(0)]}},
                                    greedy())
