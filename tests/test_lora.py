"""LoRA adapters (PEFT's format) against peft's own PeftModel in fp32: several
adapters and the base model in the same steps, more adapters than slots (a
request waits for a slot; a slot and the host cache are reused), chunked
prefill, prefix caching keyed by adapter, two tensor-parallel ranks; the
errors; and the real SmolLM2 server (GGUF blocks, bf16) with --lora-modules,
vLLM's load/unload endpoints and the openai client."""
import copy
import json
import re
import shutil
import subprocess
import sys

import httpx
import openai
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from engine import LLM, EngineArgs, InvalidRequest, LoRARequest, SamplingParams
from tests.fixtures_models import SHAKESPEARE, hf_gguf_model
from tests.test_server_process import REPO, ServerProcess
from tests.tiny_models import save_tiny_gemma3, save_tiny_llama, save_tiny_qwen3, token_prompts, write_peft

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Three adapters that differ in what a wrong implementation would get wrong:
# ranks, targets (fused sub-projections left out), rsLoRA and per-module alpha.
ADAPTERS = {
    "all8": dict(r=8, lora_alpha=16, target_modules=ALL),
    "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], use_rslora=True),
    "od16": dict(r=16, lora_alpha=16, target_modules=["o_proj", "down_proj", "k_proj"],
                 alpha_pattern={"down_proj": 48}),
}


def save_adapter(base, path, seed: int, **cfg) -> PeftModel:
    """A random (not zero-initialised) PEFT adapter over a copy of base, saved to path."""
    torch.manual_seed(seed)
    pm = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **cfg))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.mul_(4)       # big enough to change greedy tokens on the sharpened tiny models
    pm.save_pretrained(str(path))
    return pm.eval()


def reference(model, prompt: list[int], n: int) -> tuple[list[float], list[int]]:
    """(prompt logprobs from position 1, n greedy tokens) of a transformers / peft model."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1)
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return [lp[i - 1, prompt[i]].item() for i in range(1, len(prompt))], ids[len(prompt):]


SAVERS = {"llama": save_tiny_llama, "qwen3": save_tiny_qwen3, "gemma3": save_tiny_gemma3}


@pytest.fixture(scope="module", params=sorted(SAVERS))
def family(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"lora_{request.param}")
    base = SAVERS[request.param](d / "model").eval()
    refs = {name: save_adapter(base, d / name, seed=i, **cfg) for i, (name, cfg) in enumerate(ADAPTERS.items())}
    loras = {name: LoRARequest(name, i + 1, str(d / name)) for i, name in enumerate(ADAPTERS)}
    return d / "model", base, refs, loras


def test_adapters_in_one_batch_equal_peft(family):
    path, base, refs, loras = family
    # Two slots for three adapters: the third waits for one, slots and the
    # host cache (two entries) are reused, and adapters are read again.
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, max_num_batched_tokens=24,
              enable_lora=True, max_loras=2, max_cpu_loras=2)
    order = ["all8", "qv4", None, "od16", "all8", "od16", "qv4", None, "od16"]
    prompts = token_prompts(len(order), lo=10, hi=40, seed=3)
    sp = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, sp, lora_request=[loras[n] if n else None for n in order])
    changed = 0
    for name, prompt, out in zip(order, prompts, outs):
        want_lp, want = reference(refs[name] if name else base, prompt, 6)
        got_lp = [out.prompt_logprobs[i][prompt[i]] for i in range(1, len(prompt))]
        assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 1e-4, name
        assert out.outputs[0].token_ids == want, name
        changed += name is not None and want != reference(base, prompt, 6)[1]
    assert changed >= 4         # the adapters change what the model says
    assert llm.core.loras.model.cache.keys() <= set(range(1, 4)) and len(llm.core.loras.model.cache) <= 2


def test_prefix_cache_is_per_adapter(family):
    path, base, refs, loras = family
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, block_size=4, enable_lora=True, max_loras=2)
    prompt = token_prompts(1, lo=40, hi=41, seed=5)[0]
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def run(lora):
        return llm.generate([prompt], sp, lora_request=lora)[0]
    run(loras["all8"])
    again = run(loras["all8"])
    assert again.num_cached_tokens >= 32
    other = run(loras["qv4"])           # the same tokens under another adapter: other KV
    assert other.num_cached_tokens == 0
    assert other.outputs[0].token_ids == reference(refs["qv4"], prompt, 2)[1]
    assert run(None).num_cached_tokens == 0
    assert again.outputs[0].token_ids == reference(refs["all8"], prompt, 2)[1]


def test_an_adapter_waiting_for_a_slot_is_not_starved(family):
    """One slot, a stream of requests for the adapter in it and one for
    another adapter: requests behind the waiting one do not join the busy
    slot (it drains), so the waiting adapter runs before them; everything
    gives peft's tokens."""
    path, base, refs, loras = family
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, enable_lora=True, max_loras=1)
    order = ["all8"] * 3 + ["qv4"] + ["all8"] * 3
    prompts = token_prompts(len(order), lo=5, hi=12, seed=13)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    rids = [llm.add_request(p, sp, lora_request=loras[n]) for p, n in zip(prompts, order)]
    started, done = [], {}
    for _ in range(200):
        if not llm.core.has_work():
            break
        for o in llm.step():
            if o.outputs[0].token_ids and o.request_id not in started:
                started.append(o.request_id)
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert started == rids            # first come, first served across adapters
    for rid, p, n in zip(rids, prompts, order):
        assert done[rid] == reference(refs[n], p, 8)[1]


def test_unloaded_adapter_finishes_its_requests(family):
    """An adapter removed while a request for it waits (its slot busy) still
    runs that request with it; new requests must name it again."""
    path, base, refs, loras = family
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, enable_lora=True, max_loras=1)
    prompts = token_prompts(2, lo=5, hi=12, seed=17)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = llm.add_request(prompts[0], sp, lora_request=loras["all8"])
    waiting = llm.add_request(prompts[1], sp, lora_request=loras["qv4"])
    llm.step()
    assert [r.lora.lora_name for r in llm.core.scheduler.waiting] == ["qv4"]      # the one slot is busy
    llm.remove_lora(loras["qv4"].lora_int_id)
    assert loras["qv4"].lora_int_id not in llm.core.loras.adapters
    done = {}
    for _ in range(100):
        if not llm.core.has_work():
            break
        done.update({o.request_id: o.outputs[0].token_ids for o in llm.step() if o.finished})
    assert done[first] == reference(refs["all8"], prompts[0], 6)[1]
    assert done[waiting] == reference(refs["qv4"], prompts[1], 6)[1]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_adapter_whose_files_went_fails_its_request_only(family, tmp_path, async_scheduling):
    """An adapter that left the slots and the host cache is read again when
    a request needs it; with its directory gone that request ends with
    finish_reason "error" saying why, and the engine serves on."""
    path, base, refs, loras = family
    shutil.copytree(loras["qv4"].lora_path, tmp_path / "qv4")
    moved = LoRARequest("moved", 9, str(tmp_path / "qv4"))
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, enable_lora=True, max_loras=1,
              max_cpu_loras=1, async_scheduling=async_scheduling)
    prompts = token_prompts(3, lo=5, hi=12, seed=19)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert llm.generate(prompts[0], sp, lora_request=moved)[0].outputs[0].token_ids == \
        reference(refs["qv4"], prompts[0], 4)[1]
    llm.generate(prompts[1], sp, lora_request=loras["all8"])       # "moved" leaves its slot and the cache
    assert 9 not in llm.core.loras.model.cache
    shutil.rmtree(tmp_path / "qv4")
    outs = llm.generate(prompts, sp, lora_request=[loras["all8"], moved, None])
    bad = outs[1].outputs[0]
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert "'moved' could not be read again" in bad.stop_reason and "not a directory" in bad.stop_reason
    assert outs[0].outputs[0].token_ids == reference(refs["all8"], prompts[0], 4)[1]
    assert outs[2].outputs[0].token_ids == reference(base, prompts[2], 4)[1]
    assert not llm.core.has_work() and not llm.core.scheduler.requests
    assert llm.core.kv.usage == 0


def test_adapters_going_into_slots_stay_on_the_host_until_loaded(family):
    """Two adapters admitted in one pass with one host-cache entry per slot:
    the first is not evicted by the second's read before its step loads it
    (it would be read from disk again at the load, outside the error path)."""
    path, base, refs, loras = family
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, enable_lora=True, max_loras=2,
              max_cpu_loras=2)
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    p = token_prompts(3, lo=5, hi=12, seed=23)
    llm.generate(p[0], sp, lora_request=loras["od16"])      # od16: in a slot and the cache
    for prompt, name in zip(p[1:], ("all8", "qv4")):
        llm.add_request(prompt, sp, lora_request=loras[name])
    model = llm.core.loras.model
    reads = []
    real = model.read
    model.read = lambda i, path: (reads.append(i), real(i, path))[1]
    llm.core.scheduler.schedule()           # both admitted: each read once, neither evicted before loading
    assert sorted(reads) == [1, 2] and {1, 2} <= set(model.cache)


def test_tensor_parallel(tmp_path):
    """Two ranks equal PEFT; the leader's step plan carries the adapter to
    the follower, so an adapter whose files went after the leader read them
    still loads there (the follower once read the files at load, and died)."""
    base = save_tiny_llama(tmp_path / "model").eval()
    ref = save_adapter(base, tmp_path / "a", seed=7, **ADAPTERS["all8"])
    ref_b = save_adapter(base, tmp_path / "b", seed=8, **ADAPTERS["qv4"])
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    gone = LoRARequest("b", 2, str(tmp_path / "b"))
    llm = LLM(str(tmp_path / "model"), dtype="float32", kv_cache_memory=8 << 20, enable_lora=True,
              tensor_parallel_size=2)
    try:
        prompts = token_prompts(3, lo=10, hi=30, seed=9)
        sp = SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=0, ignore_eos=True)
        outs = llm.generate(prompts, sp, lora_request=[lora, None, lora])
        for prompt, out, model in zip(prompts, outs, (ref, base, ref)):
            want_lp, want = reference(model, prompt, 5)
            got_lp = [out.prompt_logprobs[i][prompt[i]] for i in range(1, len(prompt))]
            assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 1e-4
            assert out.outputs[0].token_ids == want
        llm.add_lora(gone)              # read by the leader, then its files go
        shutil.rmtree(tmp_path / "b")
        out = llm.generate(prompts[0], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                           lora_request=gone)[0]
        assert out.outputs[0].token_ids == reference(ref_b, prompts[0], 5)[1]
    finally:
        llm.close()


def test_bad_adapters_are_refused(tmp_path):
    save_tiny_llama(tmp_path / "model")
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineArgs(model=str(tmp_path / "model"), enable_lora=True, max_loras=2, max_cpu_loras=1).validate()
    plain = LLM(str(tmp_path / "model"), dtype="float32", kv_cache_memory=4 << 20)
    with pytest.raises(InvalidRequest, match="LoRA is not enabled"):
        plain.generate([[1, 2, 3]], SamplingParams(max_tokens=1), lora_request=LoRARequest("x", 1, str(tmp_path)))
    llm = LLM(str(tmp_path / "model"), dtype="float32", kv_cache_memory=4 << 20, enable_lora=True, max_lora_rank=4)
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    cases = {
        "missing": ("not a directory", None, {}),
        "rank": ("above --max-lora-rank 4", {f"{q}.lora_A.weight": torch.zeros(8, 64),
                                            f"{q}.lora_B.weight": torch.zeros(64, 8)}, {}),
        "shape": ("shape mismatch", {f"{q}.lora_A.weight": torch.zeros(4, 32),
                                     f"{q}.lora_B.weight": torch.zeros(64, 4)}, {}),
        "head": ("not a linear layer", {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
                                        "base_model.model.lm_head.lora_B.weight": torch.zeros(256, 4)}, {}),
        "half": ("lora_A only", {f"{q}.lora_A.weight": torch.zeros(4, 64)}, {}),
        "dora": ("use_dora", {f"{q}.lora_A.weight": torch.zeros(4, 64), f"{q}.lora_B.weight": torch.zeros(64, 4)},
                 {"use_dora": True}),
    }
    for i, (name, (words, tensors, cfg)) in enumerate(cases.items()):
        if tensors is not None:
            write_peft(tmp_path / name, tensors, **cfg)
        with pytest.raises(InvalidRequest, match=re.escape(words)):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1),
                         lora_request=LoRARequest(name, i + 1, str(tmp_path / name)))
    # Nothing was queued or kept by the refusals: the engine still serves.
    assert not llm.core.has_work() and not llm.core.loras.adapters
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


# -- rows with their own slots: captured decode steps ---------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_kernels_equal_torch(dtype):
    """lora_triton.add (interpreted) and gathered_add against the per-row
    product, rows of slot -1 untouched; ranks (48 = 3 x 16) and K, N that are
    no multiple of the tiles."""
    from parallel import lora_triton
    from parallel.lora import gathered_add
    torch.manual_seed(0)
    T, K, N, R, S = 7, 200, 150, 48, 3
    x, y = torch.randn(T, K).to(dtype), torch.randn(T, N).to(dtype)
    a, b = torch.randn(S, R, K).to(dtype), torch.randn(S, N, R).to(dtype)
    slots = torch.tensor([2, -1, 0, 0, 1, -1, 2], dtype=torch.int32)
    want = y.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[t] += b[s].double() @ (a[s].double() @ x[t].double())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for fn in (lora_triton.add, gathered_add):
        got = fn(x, y.clone(), a, b, slots).double()
        assert torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item()), fn
        assert torch.equal(got[slots < 0], y[slots < 0].double())


@pytest.mark.parametrize("arch", [90, 121])
def test_token_kernels_compile_for_gpus(arch):
    # Llama-8B's widest shapes (K 14336 into down_proj; N 14336 x 2 out of
    # gate/up) at ranks 16 x 3 and 64: no spills, shared memory within sm_90's and sm_121's.
    from parallel.lora_triton import tiles
    from triton_compile import assert_fit, spec
    cases, specs = [], []
    for R, K, N in ((48, 4096, 6144), (64, 14336, 4096), (128, 4096, 28672)):
        c = tiles(R, K, N)
        for kernel, const, ptrs in (
                ("shrink", dict(BLOCK_R=c["shrink_r"], BLOCK_K=c["shrink_k"]),
                 dict(x_ptr="bf16", a_ptr="bf16", slot_ptr="i32", s_ptr="fp32")),
                ("expand", dict(BLOCK_N=c["expand_n"], BLOCK_R=c["expand_r"]),
                 dict(s_ptr="fp32", b_ptr="bf16", slot_ptr="i32", y_ptr="bf16"))):
            cases.append((kernel, R, K, N))
            specs.append(spec(f"parallel.lora_triton:lora_{kernel}_kernel", arch, const, ptrs, warps=4))
    assert_fit(cases, specs)


def test_captured_decode_steps_with_adapters(family, monkeypatch):
    """Decode steps with adapters replay (emulated graphs, the Triton kernels
    interpreted), a 3-request batch padded to 4, and give the eager tokens."""
    from model_zoo import cpu_ops
    from parallel import lora_triton
    from test_cuda_graph import _emulate, _engine
    monkeypatch.setenv("TQSERVE_ATTN_BACKEND", "dense-triton")      # the CUDA path, as test_cuda_graph's graph_env
    monkeypatch.setattr(cpu_ops, "ENABLED", False)
    path, base, refs, loras = family
    prompts = token_prompts(3, lo=5, hi=20, seed=11)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    picks = [loras["all8"], None, loras["qv4"]]
    llm = _engine(path, enable_lora=True, max_loras=2)
    llm.core.lora.ctx.token_add = lora_triton.add
    replays = _emulate(llm)
    outs = llm.generate(prompts, sp, lora_request=picks)
    assert replays and 4 in replays
    for prompt, out, pick in zip(prompts, outs, picks):
        assert out.outputs[0].token_ids == reference(refs[pick.lora_name] if pick else base, prompt, 6)[1]


# -- the real SmolLM2 server ---------------------------------------------------
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def smollm2_adapters(tmp_path_factory):
    d = tmp_path_factory.mktemp("smollm2_lora")
    base = hf_gguf_model(MODEL)
    refs = {name: save_adapter(base, d / name, seed=i, r=8, lora_alpha=8,
                               target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
            for i, name in enumerate(("sql", "poet"))}
    return d, refs


def completion_logprobs(client, model: str, ids: list[int]) -> list[float]:
    r = client.completions.create(model=model, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    return r.choices[0].logprobs.token_logprobs[1:]


def test_server_serves_adapters(smollm2_adapters, tmp_path):
    d, refs = smollm2_adapters
    srv = ServerProcess(tmp_path / "server.log", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                        "--lora-modules", f"sql={d / 'sql'}",
                        json.dumps({"name": "poet", "path": str(d / "poet"), "base_model_name": MODEL}),
                        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {MODEL, "sql", "poet"}
        assert models["sql"].parent == MODEL and models["sql"].root == str(d / "sql")
        ids = httpx.post(srv.url + "/tokenize", json={"prompt": SHAKESPEARE.read_text()[:300]}).json()["tokens"][:48]
        # Prompt logprobs through the adapter (kept Q4_1 blocks) against peft over
        # transformers' fp32 dequantization of the same GGUF.
        base_lp = completion_logprobs(client, MODEL, ids)
        for name, ref in refs.items():
            want, _ = reference(ref, ids, 0)
            got = completion_logprobs(client, name, ids)
            assert max(abs(a - b) for a, b in zip(got, want)) < 0.05, name
            assert max(abs(a - b) for a, b in zip(got, base_lp)) > 0.5, name      # not the base model
        # Chats with the base model and both adapters at once, streamed and not.
        chats = {}
        for name in (MODEL, "sql", "poet"):
            kw = dict(model=name, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=8,
                      temperature=0)
            chats[name] = client.chat.completions.create(**kw).choices[0].message.content
            streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                stream=True, **kw) if c.choices)
            assert streamed == chats[name]
        assert len(set(chats.values())) == 3
        # Embeddings and /v1/models/{id} know the adapters too.
        vecs = {n: client.embeddings.create(model=n, input="Hi", encoding_format="float").data[0].embedding
                for n in (MODEL, "sql")}
        assert max(abs(a - b) for a, b in zip(vecs[MODEL], vecs["sql"])) > 1e-3
        assert client.models.retrieve("poet").parent == MODEL
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.completions.create(model="nope", prompt="Hi", max_tokens=1)
        metrics = httpx.get(srv.url + "/metrics").text
        assert re.search(r'tqserve:lora_requests_info\{max_lora="2",running_lora_adapters="",'
                         r'waiting_lora_adapters=""\} \d', metrics)
        # vLLM's run-time endpoints.
        load = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "sql2", "lora_path": str(d / "sql")})
        assert load.status_code == 200 and "added successfully" in load.text
        assert completion_logprobs(client, "sql2", ids) == completion_logprobs(client, "sql", ids)
        again = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "sql2", "lora_path": str(d)})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        bad = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        gone = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "sql2"})
        assert gone.status_code == 200 and "removed successfully" in gone.text
        assert "sql2" not in {m.id for m in client.models.list().data}
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="sql2", prompt="Hi", max_tokens=1)
        assert httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "sql2"}).status_code == 404
        assert completion_logprobs(client, "sql", ids) == completion_logprobs(client, "sql", ids)
        # An adapter whose directory went after it left the slots and the host
        # cache: its requests fail with a 500 saying why, the server serves on.
        shutil.copytree(d / "poet", tmp_path / "moved")
        assert httpx.post(srv.url + "/v1/load_lora_adapter",
                          json={"lora_name": "moved", "lora_path": str(tmp_path / "moved")}).status_code == 200
        kw = dict(prompt="Hi", max_tokens=2)
        client.completions.create(model="moved", **kw)
        client.completions.create(model="sql", **kw)
        client.completions.create(model="poet", **kw)        # two slots, two host copies: "moved" is out
        shutil.rmtree(tmp_path / "moved")
        with pytest.raises(openai.InternalServerError, match="'moved' could not be read again"):
            client.completions.create(model="moved", **kw)
        with pytest.raises(openai.APIError, match="'moved' could not be read again"):
            list(client.chat.completions.create(model="moved", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=2, stream=True))
        assert client.completions.create(model="sql", **kw).choices[0].finish_reason == "length"
        assert re.search(r'tqserve:request_success_total\{finished_reason="error",model_name="[^"]+"\} 2\.0',
                         httpx.get(srv.url + "/metrics").text)
    finally:
        srv.stop()
    log = srv.log()
    assert "LoRA adapter sql:" in log and "LoRA: 2 slots of rank up to 8" in log


@pytest.mark.parametrize("flags, words", [
    (["--lora-modules", "x={dir}"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "x={dir}"], "not a PEFT adapter directory"),
    (["--enable-lora", "--lora-modules", "x"], "expected name=path or a JSON object"),
    (["--enable-lora", "--max-lora-rank", "0"], "max_lora_rank must be >= 1"),
    (["--enable-lora", "--lora-modules", "a={adapter}", "a={adapter}"], "needs a name of its own"),
])
def test_bad_lora_flags_fail_at_start(tmp_path, flags, words):
    write_peft(tmp_path / "adapter", {})
    flags = [f.format(dir=tmp_path, adapter=tmp_path / "adapter") for f in flags]
    p = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", "0", *flags],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    # A one-line error and exit 2, before any weights are read.
    assert p.returncode == 2 and words in p.stderr and "tensors" not in p.stderr
