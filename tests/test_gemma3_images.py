"""Images through the engine: a tiny random Gemma3ForConditionalGeneration
(SigLIP tower + projector + Gemma 3 text, fp32) against transformers' model
on the same images: greedy tokens equal its generate(), prompt and output
logprobs within 1e-4, with an image's tokens attending to each other
(transformers' token_type_ids mask; the causal mask gives other logits, so
the check can fail). Chunked prefill never cuts an image, prefix caching
tells images apart, each image is encoded once, and bad inputs are refused
with a clear message."""
import copy

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
    """transformers' greedy tokens and the log-softmax over prompt + them
    (on hf's device, the pixels in its dtype)."""
    w = next(hf.parameters())
    x = torch.tensor([ids], device=w.device)
    kw = dict(pixel_values=hf_pixels(images).to(w.device, w.dtype)) if images else {}
    tt = (x == IMG).long()
    with torch.no_grad():
        got = hf.generate(x, attention_mask=torch.ones_like(x), token_type_ids=tt, max_new_tokens=max_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0, **kw)[0, len(ids):].tolist()
        full = torch.tensor([ids + got], device=w.device)
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


# --------------------------------------------------------------------------
# Over HTTP: OpenAI's client with image_url parts against a live server.
# --------------------------------------------------------------------------
# google/gemma-3-4b-it's chat template (its images are {"type": "image"} parts).
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The tiny vision model with SmolLM2's tokenizer plus Gemma 3's image tokens and chat template."""
    from tests.fixtures_models import hf_tokenizer
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig
    d = tmp_path_factory.mktemp("gemma3_vision_chat")
    tok = copy.deepcopy(hf_tokenizer("smollm2-135m"))       # (the cached one other tests read stays as it is)
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_image>", "<end_of_image>",
                                                         "<image_soft_token>"]})
    tok.chat_template = GEMMA3_TEMPLATE
    boi, eoi, img = tok.convert_tokens_to_ids(["<start_of_image>", "<end_of_image>", "<image_soft_token>"])
    torch.manual_seed(5)
    text = Gemma3TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=32,
                            layer_types=["sliding_attention", "full_attention"], max_position_embeddings=1024,
                            query_pre_attn_scalar=32, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vision = SiglipVisionConfig(image_size=32, patch_size=4, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=2)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=N_IMG, image_token_index=img,
                       boi_token_index=boi, eoi_token_index=eoi, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id)
    m = Gemma3ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "mm_input_projection" in n:
                p.copy_(torch.randn_like(p) * 0.5)
            elif "norm" not in n and "vision" not in n:
                p.mul_(4.0)
    m.save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)
    from transformers import AutoTokenizer     # with the names Gemma3Processor reads
    tok = AutoTokenizer.from_pretrained(d, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    return d, m, tok


@pytest.fixture(scope="module")
def chat_server(chat_model, tmp_path_factory):
    from tests.test_server_process import ServerProcess
    path, _, _ = chat_model
    media = tmp_path_factory.mktemp("media")
    image(7).save(media / "seven.png")
    srv = ServerProcess(tmp_path_factory.mktemp("vision-server") / "server.log", "--model", str(path),
                        "--dtype", "float32", "--kv-cache-memory", "16MiB", "--allowed-local-media-path", str(media),
                        "--limit-mm-per-prompt", '{"image": 2}')
    srv.media = media
    yield srv
    srv.stop()


def data_url(im: Image.Image) -> str:
    import base64
    import io
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def hf_processed(tok, images, text=None, parts=None):
    """Gemma3Processor's inputs for text, or for one user message of parts
    rendered by the chat template."""
    from transformers.models.gemma3 import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    proc = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
                           tokenizer=tok, image_seq_length=N_IMG, chat_template=GEMMA3_TEMPLATE)
    if parts is not None:
        text = proc.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                        tokenize=False)
    return proc(text=[text], images=[images], return_tensors="pt")


def hf_generated(hf, x, n: int) -> list[int]:
    with torch.no_grad():
        return hf.generate(**x, max_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, x["input_ids"].shape[1]:].tolist()


def test_chat_with_images_over_http_equals_transformers(chat_model, chat_server):
    """Data URL, file:// and http:// images through OpenAI's client: the
    prompt ids equal transformers' Gemma3Processor's and the greedy tokens
    its model's."""
    import http.server
    import threading

    import openai
    path, hf, tok = chat_model
    served = image(8, (40, 30))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            import io
            buf = io.BytesIO()
            served.save(buf, format="PNG")
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(buf.getvalue())

        def log_message(self, *a):
            pass
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    client = openai.OpenAI(base_url=chat_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    cases = [([image(6)], [data_url(image(6))]),
             ([image(7), served], ["file://" + str(chat_server.media / "seven.png"),
                                   f"http://127.0.0.1:{httpd.server_address[1]}/x.png"])]
    try:
        for images, urls in cases:
            parts = [{"type": "text", "text": "Compare"}] + \
                [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": "now."}]
            r = client.chat.completions.create(
                model=str(path), messages=[{"role": "user", "content": parts}], max_tokens=6, temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True})
            x = hf_processed(tok, images, parts=[{"type": "text", "text": "Compare"}] +
                             [{"type": "image"}] * len(urls) + [{"type": "text", "text": "now."}])
            assert r.prompt_token_ids == x["input_ids"][0].tolist()
            assert r.choices[0].token_ids == hf_generated(hf, x, 6)
            assert r.usage.prompt_tokens == len(r.prompt_token_ids)
        assert f"prompt_tokens={len(r.prompt_token_ids)} images=2 output_tokens=6" in chat_server.log()
    finally:
        httpd.shutdown()


@pytest.mark.parametrize("url, words", [
    ("data:image/png;base64,@@@", "not valid base64"),
    ("data:image/png;base64,aGVsbG8=", "cannot be decoded"),
    ("file:///etc/passwd", "outside --allowed-local-media-path"),
    ("ftp://x/y.png", "data:, http(s):// or file://"),
    ("http://127.0.0.1:9/none.png", "could not be fetched"),
])
def test_bad_image_urls_are_a_400(chat_model, chat_server, url, words):
    import openai
    path, _, _ = chat_model
    client = openai.OpenAI(base_url=chat_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=str(path), max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
    assert words in e.value.body["message"], e.value.body


def test_too_many_images_and_misplaced_images_are_a_400(chat_model, chat_server):
    import openai
    path, _, _ = chat_model
    client = openai.OpenAI(base_url=chat_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    part = {"type": "image_url", "image_url": {"url": data_url(image(1))}}
    with pytest.raises(openai.BadRequestError, match="at most 2 image"):
        client.chat.completions.create(model=str(path), max_tokens=2,
                                       messages=[{"role": "user", "content": [part] * 3}])
    with pytest.raises(openai.BadRequestError, match="user messages"):
        client.chat.completions.create(model=str(path), max_tokens=2, messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": [part]}])
    # The server is still fine.
    r = client.chat.completions.create(model=str(path), max_tokens=2, messages=[
        {"role": "user", "content": [part, {"type": "text", "text": "ok?"}]}])
    assert r.choices[0].finish_reason in ("length", "stop")


def test_tensor_parallel_images_equal_one_rank(model):
    """Two ranks: the step plan carries the images to the follower, whose own
    encoder rows fill its placeholders; the tokens and logprobs equal transformers'."""
    path, hf = model
    ids, seeds = PROMPTS[1]
    images = [image(s) for s in seeds]
    engine = llm(path, tensor_parallel_size=2, kv_cache_memory=8 << 20)
    try:
        out = engine.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}},
                              greedy(logprobs=1, prompt_logprobs=1))[0]
    finally:
        engine.close()
    ref_tokens, ref = hf_reference(hf, ids, images, 8)
    assert out.outputs[0].token_ids == ref_tokens
    assert gap(out, ids, ref) < LOGPROB_TOL


def test_responses_and_messages_apis_take_images(chat_model, chat_server):
    """/v1/responses' input_image and /v1/messages' image blocks (Anthropic's
    client) run the same prompt as chat's image_url parts: the same text."""
    import anthropic
    import openai
    path, _, _ = chat_model
    url = data_url(image(9))
    client = openai.OpenAI(base_url=chat_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    chat = client.chat.completions.create(model=str(path), max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Compare"},
                                     {"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "now."}]}]).choices[0].message.content
    assert chat
    r = client.responses.create(model=str(path), max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Compare"},
                                     {"type": "input_image", "image_url": url, "detail": "auto"},
                                     {"type": "input_text", "text": "now."}]}])
    assert r.output_text == chat
    listed = client.responses.input_items.list(r.id)
    assert [p.type for p in listed.data[0].content] == ["input_text", "input_image", "input_text"]
    a = anthropic.Anthropic(base_url=chat_server.url, api_key="none", max_retries=0, timeout=120)
    m = a.messages.create(model=str(path), max_tokens=6, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [
            {"type": "text", "text": "Compare"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]}},
            {"type": "text", "text": "now."}]}])
    assert m.content[0].text == chat
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.embeddings.create(model=str(path), input="x", extra_body={"messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}], "input": None})


@pytest.mark.parametrize("preset", ["f16", "k8v4", "tq4", "tq3", "tq4:kv"])
def test_kv_presets_keep_image_spans_bidirectional(model, preset):
    """Every KV preset: the prompt's logprobs stay nearer transformers'
    bidirectional image mask than its causal one (the compressed backends
    honour the spans), and chunks that stop before each image give the
    tokens of whole-prompt prefill."""
    path, hf = model
    kv, _, hot = preset.partition(":")
    kw = dict(kv_cache_dtype=kv, **({"kv_hot": hot} if hot else {}))
    ids, seeds = PROMPTS[1]
    images = [image(s) for s in seeds]
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
    out = llm(path, **kw).generate(prompt, greedy(prompt_logprobs=1))[0]
    _, bidir = hf_reference(hf, ids, images, 8)
    _, causal = hf_reference(hf, ids, images, 8, bidirectional=False)

    def mean_gap(ref):
        return sum(abs(out.prompt_logprobs[i][ids[i]] - ref[i - 1, ids[i]].item())
                   for i in range(1, len(ids))) / (len(ids) - 1)
    print(f"{preset}: mean |prompt logprob - transformers| bidirectional {mean_gap(bidir):.3g}, "
          f"causal {mean_gap(causal):.3g}")
    assert mean_gap(bidir) < 0.5 * mean_gap(causal)
    chunked = llm(path, max_num_batched_tokens=N_IMG + 3, enable_prefix_caching=False, **kw)
    assert chunked.generate(prompt, greedy())[0].outputs[0].token_ids == out.outputs[0].token_ids


@pytest.mark.parametrize("backends", ["dense-triton", "tq-triton"])
def test_triton_backends_run_image_spans(model, monkeypatch, backends):
    """The GPU backends (under Triton's interpreter here) through the engine:
    dense-triton equals transformers' logprobs; tq-triton (tq4) stays nearer
    the bidirectional mask than the causal one."""
    path, hf = model
    monkeypatch.setenv("TQSERVE_ATTN_BACKEND", "dense-triton,tq-triton")
    ids, seeds = PROMPTS[0]
    images = [image(s) for s in seeds]
    kw = {"kv_cache_dtype": "tq4"} if backends == "tq-triton" else {}
    engine = llm(path, **kw)
    names = {c.backend.name for c in engine.core.runner.kv_caches}
    assert backends in names and names <= {"dense-triton", "tq-triton"}   # (tq4 keeps some layers dense)
    out = engine.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}},
                          greedy(4, logprobs=1, prompt_logprobs=1))[0]
    _, bidir = hf_reference(hf, ids, images, 4)
    if backends == "dense-triton":
        assert gap(out, ids, bidir) < LOGPROB_TOL
    else:
        _, causal = hf_reference(hf, ids, images, 4, bidirectional=False)
        mean = [sum(abs(out.prompt_logprobs[i][ids[i]] - r[i - 1, ids[i]].item()) for i in range(1, len(ids)))
                for r in (bidir, causal)]
        assert mean[0] < 0.5 * mean[1]


def test_offline_chat_takes_images(chat_model):
    """LLM.chat with vLLM's image_pil and data-URL image_url parts: the prompt
    Gemma3Processor builds, and transformers' tokens."""
    path, hf, tok = chat_model
    engine = LLM(str(path), dtype="float32", quantization="none")
    images = [image(11), image(12)]
    out = engine.chat([{"role": "user", "content": [
        {"type": "image_pil", "image_pil": images[0]}, {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": data_url(images[1])}}]}], greedy(5))
    x = hf_processed(tok, images, parts=[{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}])
    assert out.prompt_token_ids == x["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == hf_generated(hf, x, 5)
    with pytest.raises(InvalidRequest, match="data: URLs"):
        engine.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])


# --------------------------------------------------------------------------
# llama.cpp's layout: a Gemma 3 GGUF plus its mmproj GGUF (--mmproj).
# --------------------------------------------------------------------------
def write_gguf_pair(folder, hf):
    """hf (save_tiny_gemma3_vision's) as llama.cpp's converter writes it: the
    language model as a gemma3 GGUF (norms w + 1, tied embedding) with a
    token list that has Gemma 3's image tokens at their ids, and the tower as
    an mmproj (clip) GGUF (projector norm w + 1, input projection F16)."""
    import gguf
    from test_gguf_hybrid import finish
    text, vision = hf.config.text_config, hf.config.vision_config
    L = text.num_hidden_layers
    w = gguf.GGUFWriter(str(folder / "model.gguf"), "gemma3")
    w.add_block_count(L)
    w.add_context_length(text.max_position_embeddings)
    w.add_embedding_length(text.hidden_size)
    w.add_feed_forward_length(text.intermediate_size)
    w.add_head_count(text.num_attention_heads)
    w.add_head_count_kv(text.num_key_value_heads)
    w.add_key_length(text.head_dim)
    w.add_value_length(text.head_dim)
    w.add_layer_norm_rms_eps(text.rms_norm_eps)
    w.add_rope_freq_base(text.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(text.sliding_window)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in text.layer_types])
    w.add_vocab_size(text.vocab_size)
    special = {0: "<pad>", 1: "<bos>", 2: "<eos>", IMG: "<image_soft_token>", BOI: "<start_of_image>",
               EOI: "<end_of_image>"}
    tokens = [special.get(i, f"t{i}") for i in range(text.vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(text.vocab_size)])
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, L)
    out = {}
    for k, v in hf.state_dict().items():
        if not k.startswith("model.language_model."):
            continue
        a = v.detach().float().numpy()
        stem, suffix = k.replace("model.language_model.", "model.").rsplit(".", 1)
        out[f"{names.get_name(stem)}.{suffix}"] = a + 1.0 if "norm" in stem else a
    finish(w, out, "F32")

    m = gguf.GGUFWriter(str(folder / "mmproj.gguf"), "clip")
    m.add_bool("clip.has_vision_encoder", True)
    m.add_string("clip.vision.projector_type", "gemma3")
    for key, value in (("image_size", vision.image_size), ("patch_size", vision.patch_size),
                       ("embedding_length", vision.hidden_size), ("feed_forward_length", vision.intermediate_size),
                       ("block_count", vision.num_hidden_layers), ("attention.head_count", vision.num_attention_heads),
                       ("projector.scale_factor", vision.image_size // vision.patch_size // int(N_IMG ** 0.5))):
        m.add_uint32(f"clip.vision.{key}", value)
    m.add_float32("clip.vision.attention.layer_norm_epsilon", vision.layer_norm_eps)
    m.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    m.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    vnames = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.num_hidden_layers)
    for k, v in hf.state_dict().items():
        if "vision_tower." not in k and "multi_modal_projector." not in k:
            continue
        if ".head." in k:
            continue
        a = v.detach().float().numpy()
        hub = k.replace("model.", "", 1).replace("vision_tower.", "vision_tower.vision_model.", 1) \
            if "vision_tower.vision_model." not in k else k.replace("model.", "", 1)
        stem, suffix = hub.replace("_weight", ".weight").rsplit(".", 1)
        name = f"{vnames.get_name(stem)}.{suffix}"
        if "soft_emb_norm" in name:
            a = a + 1.0
        m.add_tensor(name, a.astype(np.float16) if "input_projection" in name else a)
    m.write_header_to_file()
    m.write_kv_data_to_file()
    m.write_tensors_to_file()
    m.close()


def test_gguf_with_mmproj_equals_transformers(model, tmp_path):
    """--mmproj: the GGUF pair gives transformers' tokens and logprobs (its
    input projection rounded to F16 as the converter stores it)."""
    path, _ = model
    from transformers import Gemma3ForConditionalGeneration
    hf = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        p = hf.model.multi_modal_projector.mm_input_projection_weight
        p.copy_(p.half().float())
    write_gguf_pair(tmp_path, hf)
    engine = LLM(str(tmp_path / "model.gguf"), mmproj=str(tmp_path / "mmproj.gguf"), dtype="float32",
                 quantization="none", block_size=4)
    ids, seeds = PROMPTS[1]
    images = [image(s) for s in seeds]
    out = engine.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}},
                          greedy(logprobs=1, prompt_logprobs=1))[0]
    ref_tokens, ref = hf_reference(hf, ids, images, 8)
    assert out.outputs[0].token_ids == ref_tokens
    assert gap(out, ids, ref) < LOGPROB_TOL
    with pytest.raises(Exception, match="not a multimodal projector"):
        LLM(str(tmp_path / "model.gguf"), mmproj=str(tmp_path / "model.gguf"))
    # tqserve plan --mmproj counts the tower (float32 here) in the formula and the measured bytes.
    from server import plan
    tower = 4 * sum(p.numel() for n, p in hf.named_parameters()       # (SigLIP's unused pooling head: not)
                    if ("vision_tower" in n or "multi_modal" in n) and ".head." not in n)
    with_tower = plan.make_plan(str(tmp_path / "model.gguf"), 1, "f16", dtype="float32",
                                mmproj=str(tmp_path / "mmproj.gguf"))
    text = plan.make_plan(str(tmp_path / "model.gguf"), 1, "f16", dtype="float32")
    assert with_tower.weight_parts["vision tower (replicated)"] == tower
    assert with_tower.measured_weight_bytes - text.measured_weight_bytes == tower


def test_draft_model_speculation_with_images(model, tmp_path):
    """A text draft model beside the vision target (its vocabulary ends before
    the image tokens): the greedy tokens are the target's alone."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    path, _ = model
    torch.manual_seed(4)
    Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=IMG, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                       bos_token_id=1, eos_token_id=2)).save_pretrained(tmp_path)
    ids, seeds = PROMPTS[1]
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": [image(s) for s in seeds]}}
    want = llm(path).generate(prompt, greedy(10))[0].outputs[0].token_ids
    spec = llm(path, speculative_config={"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3})
    assert spec.generate(prompt, greedy(10))[0].outputs[0].token_ids == want


def test_llamacpp_completion_with_multimodal_data(chat_model, chat_server):
    """llama.cpp's /completion prompt {prompt_string, multimodal_data}: each
    <__media__> an image (raw base64 or a data: URL), expanded as
    Gemma3Processor expands <start_of_image>; transformers' tokens."""
    import httpx
    path, hf, tok = chat_model
    images = [image(13), image(14)]
    urls = [data_url(im) for im in images]
    r = httpx.post(chat_server.url + "/completion", timeout=120, json={
        "prompt": {"prompt_string": "Compare <__media__> and <__media__> now.",
                   "multimodal_data": [urls[0].split(",", 1)[1], urls[1]]},
        "n_predict": 6, "temperature": 0, "return_tokens": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    x = hf_processed(tok, images, text="Compare <start_of_image> and <start_of_image> now.")
    body = r.json()
    assert body["tokens"] == hf_generated(hf, x, 6) and body["tokens_evaluated"] == x["input_ids"].shape[1]
    bad = httpx.post(chat_server.url + "/completion", timeout=60, json={
        "prompt": {"prompt_string": "no marker", "multimodal_data": [urls[0]]}, "n_predict": 2})
    assert bad.status_code == 400 and "<__media__>" in bad.json()["error"]["message"]


def test_preemption_recomputes_images(model):
    """A pool too small for every image prompt at once: preempted requests
    recompute their prompts (images encoded again or from the encoder's
    cache) and give the tokens they give alone; nothing stays allocated."""
    path, _ = model
    prompts = [{"prompt_token_ids": prompt_ids([5 + i], "img", [9, 10 + i], "img", [11]),
                "multi_modal_data": {"image": [image(20 + i), image(30 + i)]}} for i in range(4)]
    ref = [llm(path).generate(p, greedy(30))[0].outputs[0].token_ids for p in prompts]
    # Room for ~2 of the 4 sequences (~71 tokens each, in the full and the sliding layers' blocks).
    small = llm(path, kv_cache_memory=230_000, max_model_len=80, max_num_seqs=4)
    assert small.core.plan.capacity_tokens < 200
    outs = small.generate(prompts, greedy(30))
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert small.core.get_stats().num_preemptions_total > 0
    assert small.core.kv.num_used_blocks == 0
