"""Engine startup on a device, checked on CPU: EngineArgs' device options and
their resolution, the meta-device build (bit-identical to building in memory
and loading, ties and loaders kept, no memory doubled), load_format dummy on a
config-only directory, model forward and KV storage following the device
(run on the meta device, where any tensor left on the CPU raises), and the
KV budget's arithmetic."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from test_deepseek_v4 import CONFIG as DSV4_CONFIG
from test_deepseek_v4 import hf_config as dsv4_hf_config
from test_deepseek_v4 import randomise as dsv4_randomise
from test_model_parity import CONFIGS, make_hf_model

from engine import LLM, SamplingParams
from engine.engine_args import EngineArgs
from engine.kv_calibration import _attention, capture_qkv
from kvcache.attention import Attention
from kvcache.dense_cache import DenseLayerCache
from kvcache.dsv4_paged import DSV4PagedCache
from kvcache.pool_plan import (DEFAULT_KV_BYTES, allocate_kv_caches, available_memory, device_kv_budget,
                               kv_budget, kv_dtype, plan_kv_pool)
from kvcache.tq_cache import TQLayerCache
from model_zoo.models import build_model, create_model, materialize
from model_zoo.source import ModelLoadError

GiB = 1 << 30


# ---------------------------------------------------------------- EngineArgs

def test_engine_args_defaults():
    a = EngineArgs()
    assert (a.device, a.dtype, a.load_format, a.gpu_memory_utilization, a.enforce_eager) == \
        ("auto", "auto", "auto", 0.9, False)


@pytest.mark.parametrize("cuda", [False, True])
def test_auto_resolves_in_one_place(monkeypatch, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    r = EngineArgs().resolved()
    assert (r.device, r.dtype) == (("cuda", "bfloat16") if cuda else ("cpu", "float32"))
    assert EngineArgs(dtype="float16").resolved().dtype == "float16"
    assert EngineArgs(device="cpu").resolved() == EngineArgs(device="cpu", dtype="float32", quantization=None)
    assert EngineArgs().device == "auto"       # the caller's args are not changed


@pytest.mark.parametrize("kw, cuda, match", [
    (dict(device="tpu"), False, "unknown device 'tpu'; supported: auto, cuda, cpu"),
    (dict(device="cuda"), False, r"device cuda requested but torch.cuda.is_available\(\) is False \(torch "),
    (dict(dtype="float64"), False, "unknown dtype"),
    (dict(load_format="safetensors"), False, "unknown load_format"),
    (dict(gpu_memory_utilization=0.0), False, r"gpu_memory_utilization must be in \(0, 1\]"),
    (dict(gpu_memory_utilization=1.5), False, r"gpu_memory_utilization must be in \(0, 1\]"),
    (dict(enforce_eager="yes"), False, "enforce_eager"),
    (dict(quantization="int4", dtype="bfloat16", device="cuda"), True, "int4 is not supported on CUDA"),
    (dict(quantization="int4", dtype="bfloat16"), True, "int4 is not supported on CUDA"),   # auto -> cuda
    (dict(quantization="int4", dtype="bfloat16", load_format="dummy"), False, "dummy"),
    (dict(quantization="int4", dtype="float32"), False, "bfloat16"),
    (dict(quantization="int4"), False, "bfloat16"),          # dtype auto: float32 on conftest's AVX2 CPU
])
def test_engine_args_reject_clearly(monkeypatch, kw, cuda, match):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    with pytest.raises(ValueError, match=match) as e:
        EngineArgs(**kw).resolved()
    assert "\n" not in str(e.value)


def test_int4_on_cpu_is_still_valid(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineArgs(quantization="int4", dtype="bfloat16", device="cpu").resolved().device == "cpu"


# ---------------------------------------------------------------- meta build

def _cases():
    return [(k, c) for k, c in CONFIGS.items()] + [("deepseek_v4", DSV4_CONFIG)]


def _checkpoint(key, config):
    if key == "deepseek_v4":
        import transformers
        hf = transformers.DeepseekV4ForCausalLM(dsv4_hf_config(config)).eval()
        dsv4_randomise(list(hf.named_parameters()) + list(hf.named_buffers()), config["n_routed_experts"],
                       config["num_experts_per_tok"])
        return hf.state_dict()
    return make_hf_model(config).state_dict()


def _old_path(config, sd, dtype):
    """What the engine did before: build in memory in dtype, then load."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = build_model(config)
    finally:
        torch.set_default_dtype(prev)
    model.load_weights(sd.items())
    return model.eval()


def _logits(model, n=40, seed=3):
    ids = torch.randint(0, model.config["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(n), None))


@pytest.mark.parametrize("key, config", _cases(), ids=[k for k, _ in _cases()])
def test_meta_build_is_bit_identical_to_the_old_path(key, config):
    sd = _checkpoint(key, config)
    with torch.device("meta"):
        on_meta = build_model(config)
    assert all(t.is_meta for t in (*on_meta.parameters(), *on_meta.buffers()))
    for dtype in (torch.float32, torch.bfloat16):
        old = _old_path(config, sd, dtype)
        new = create_model(config, dtype, "cpu", sd.items())
        assert torch.equal(_logits(old), _logits(new)), (key, dtype)
        named_old = dict((*old.named_parameters(), *old.named_buffers()))
        named_new = dict((*new.named_parameters(), *new.named_buffers()))
        assert named_old.keys() == named_new.keys()
        for n, t in named_new.items():
            assert t.device.type == "cpu" and t.dtype == named_old[n].dtype, n
            assert torch.equal(t, named_old[n]), n
            assert hasattr(t, "weight_loader") == hasattr(named_old[n], "weight_loader"), n
        if config.get("tie_word_embeddings", key == "gemma3"):
            assert new.lm_head.weight is new.model.embed_tokens.weight


def test_meta_build_reports_missing_tensors():
    config = CONFIGS["qwen3"]
    sd = _checkpoint("qwen3", config)
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model.layers.1.self_attn.k_norm.weight"):
        create_model(config, torch.float32, "cpu",
                     ((k, v) for k, v in sd.items() if k != "model.layers.1.self_attn.k_norm.weight"))
    # DeepSeek-V4 without an MTP checkpoint: the head is left zeros, not garbage.
    v4 = create_model(DSV4_CONFIG, torch.float32, "cpu", _checkpoint("deepseek_v4", DSV4_CONFIG).items())
    assert not v4.mtp_loaded
    assert all(not p.any() for p in v4.mtp.parameters())


def test_materialize_refuses_tensors_left_on_meta():
    class Stray(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(2))
            self.table = torch.arange(4)     # a constant created in the meta context
    with torch.device("meta"):
        m = Stray()
    with pytest.raises(RuntimeError, match="table"):
        materialize(m, "cpu")


_MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from model_zoo.models import build_model, create_model

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    config = json.loads(sys.argv[1])
    # Warm up (lazy imports, kernels' first-use allocations) on a tiny shape.
    create_model(dict(config, vocab_size=64, num_hidden_layers=1), torch.float32, "cpu", None, 0)
    before = status("VmRSS")
    with torch.device("meta"):
        build_model(config)
    meta_growth = status("VmRSS") - before
    try:   # reset the peak, so that it measures only what follows
        open("/proc/self/clear_refs", "w").write("5")
    except OSError:
        pass
    before = status("VmRSS")
    model = create_model(config, torch.float32, "cpu", None, 0)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps(dict(meta_growth=meta_growth, peak_growth=status("VmHWM") - before, weights=weights)))
""")


def test_building_costs_no_memory_and_loading_one_copy():
    config = dict(CONFIGS["llama"], vocab_size=16000, hidden_size=512, intermediate_size=1536,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, json.dumps(config)], capture_output=True,
                         text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print(got)
    assert got["weights"] > 80 << 20
    assert got["meta_growth"] < 4 << 20
    assert got["peak_growth"] < 1.05 * got["weights"] + (8 << 20)


# ---------------------------------------------------------------- load_format dummy

def _config_only_dir(tmp_path, config):
    d = tmp_path / "config_only"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(config, eos_token_id=2)))
    return str(d)


def test_dummy_weights_values():
    llama = create_model(CONFIGS["llama"], torch.float32, "cpu", None, seed=1)
    for n, p in llama.named_parameters():
        if "norm" in n:
            assert torch.equal(p, torch.ones_like(p)), n          # identity scale
        else:
            assert p.abs().max() <= 1e-3 and p.std() > 3e-4, n
    assert torch.equal(llama.model.layers[0].mlp.down_proj.weight,
                       create_model(CONFIGS["llama"], torch.float32, "cpu", None, seed=1)
                       .model.layers[0].mlp.down_proj.weight)
    gemma = create_model(CONFIGS["gemma3"], torch.float32, "cpu", None, seed=1)
    assert all(not p.any() for n, p in gemma.named_parameters() if "norm" in n)   # 1 + 0
    v4 = create_model(DSV4_CONFIG, torch.bfloat16, "cpu", None, seed=1)
    E, k = DSV4_CONFIG["n_routed_experts"], DSV4_CONFIG["num_experts_per_tok"]
    for name, b in v4.named_buffers():
        if name.endswith("tid2eid"):
            assert b.min() >= 0 and b.max() < E
            assert all(len(set(row)) == k for row in b.tolist())
    assert v4.model.layers[0].attn_hc.fn.dtype == torch.float32     # kept fp32 in a bf16 model


def test_dummy_engine_runs_a_config_only_dir(tmp_path):
    path = _config_only_dir(tmp_path, CONFIGS["llama"])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLM(path)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    prompts = [[5, 6, 7, 8], list(range(10, 40))]

    def run(seed):
        llm = LLM(path, load_format="dummy", seed=seed, block_size=4, kv_cache_memory=4 << 20)
        assert llm.tokenizer is None and llm.core.args.device == "cpu"
        outs = llm.generate(prompts, sp)
        assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    first = run(0)
    assert run(0) == first                       # deterministic given the seed
    assert run(1) != first                       # other weights
    with pytest.raises(Exception, match="token ids"):
        LLM(path, load_format="dummy", kv_cache_memory=4 << 20).generate(["text"], sp)


@pytest.mark.parametrize("key", ["gemma3", "deepseek_v4"])
def test_dummy_engine_other_architectures(tmp_path, key):
    config = DSV4_CONFIG if key == "deepseek_v4" else CONFIGS[key]
    llm = LLM(_config_only_dir(tmp_path, config), load_format="dummy", block_size=4, kv_cache_memory=8 << 20,
              max_num_seqs=4)
    out = llm.generate([[3, 4, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


# ---------------------------------------------------------------- the device, on "meta"

def _on_meta(config):
    with torch.device("meta"):
        model = build_model(config)
    materialize(model, "meta")
    return model.eval()


# Not the MoE families (nor DeepSeek-V4): off CUDA their experts run the torch path, which
# reads each expert's row count on the host by design (parallel/quant/moe.py).
@pytest.mark.parametrize("key", [k for k in CONFIGS if "moe" not in k])
def test_forward_and_calibration_follow_the_device(key):
    """On the meta device, a tensor the forward makes on the CPU (or a constant
    left there) raises: what passes here runs on CUDA without host tensors."""
    model = _on_meta(CONFIGS[key])
    ids = torch.zeros(12, dtype=torch.long, device="meta")
    with torch.no_grad():
        logits = model.compute_logits(model(ids, torch.arange(12, device="meta"), None))
    assert logits.device.type == "meta"
    got = capture_qkv(model, list(range(12)), grads=True)
    assert got and all(q.device.type == "meta" and g.device.type == "meta" for _, q, _, _, g in got.values())
    sliding = Attention(4, 2, 16, 0.25, 0, sliding_window=4)
    q, kv = torch.empty(12, 4, 16, device="meta"), torch.empty(12, 2, 16, device="meta")
    assert _attention(sliding, q, kv, kv).device.type == "meta"


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    elif isinstance(obj, (DenseLayerCache, TQLayerCache, DSV4PagedCache)) or type(obj).__name__ == "DSV4LayerStorage":
        for v in vars(obj).values():
            yield from _tensors(v)


@pytest.mark.parametrize("key, kv", [("gemma3", "auto"), ("llama", "tq4"), ("llama", "k8v4"),
                                     ("deepseek_v4", "auto"), ("deepseek_v4", "tq4")])
def test_kv_pool_allocates_on_the_device(key, kv):
    config = DSV4_CONFIG if key == "deepseek_v4" else CONFIGS[key]
    specs = build_model(config).kv_cache_spec()
    cdtype = kv_dtype(kv, torch.bfloat16)
    plan = plan_kv_pool(specs, 1 << 20, 4, cdtype, 4, 32, max_model_len=128)
    on_meta = allocate_kv_caches(specs, plan, cdtype, "meta")
    on_cpu = allocate_kv_caches(specs, plan, cdtype)
    meta_t, cpu_t = list(_tensors(on_meta)), list(_tensors(on_cpu))
    assert meta_t and all(t.device.type == "meta" for t in meta_t)
    assert all(t.device.type == "cpu" for t in cpu_t)
    assert [(t.shape, t.dtype) for t in meta_t] == [(t.shape, t.dtype) for t in cpu_t]
    if (key, kv) == ("llama", "tq4"):
        assert any(isinstance(c, TQLayerCache) and c.hk for c in on_meta)   # hot stores too


def test_engine_core_on_cpu_keeps_everything_on_cpu(tmp_path):
    llm = LLM(_config_only_dir(tmp_path, CONFIGS["qwen3"]), load_format="dummy", kv_cache_memory=4 << 20,
              kv_cache_dtype="tq4")
    core = llm.core
    assert core.device == torch.device("cpu") and core.args.dtype == "float32"
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in core.model.parameters())
    assert all(t.device.type == "cpu" for t in _tensors(core.runner.kv_caches))


# ---------------------------------------------------------------- KV budget

def test_device_kv_budget_arithmetic():
    assert device_kv_budget(100 * GiB, 0.9, 95 * GiB, 20 * GiB, 5 * GiB) == 65 * GiB
    assert device_kv_budget(100 * GiB, 1.0, 100 * GiB, 0, 0) == 100 * GiB
    with pytest.raises(ValueError, match=r"asks for 90.00 GiB .* 50.00 GiB was free at startup"):
        device_kv_budget(100 * GiB, 0.9, 50 * GiB, 20 * GiB, 5 * GiB)
    with pytest.raises(ValueError, match=r"no device memory left for the KV cache: 0.5 x 100.00 GiB - "
                                         r"40.00 GiB .* - 12.00 GiB activation peak"):
        device_kv_budget(100 * GiB, 0.5, 100 * GiB, 40 * GiB, 12 * GiB)


def test_host_kv_budget_unchanged():
    assert kv_budget(None, 64 * GiB) == DEFAULT_KV_BYTES == 2 * GiB
    assert kv_budget(None, 4 * GiB) == 1 * GiB
    assert kv_budget(0.25, 8 * GiB) == 2 * GiB
    assert kv_budget(123456) == 123456 and kv_budget(3 * GiB, 1) == 3 * GiB
    avail = available_memory()
    assert abs(kv_budget(0.5) - avail * 0.5) < 256 << 20      # /proc/meminfo, read again


# ---------------------------------------------------------------- on a GPU (skipped without one)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("key", ["llama", "gemma3", "deepseek_v4"])
def test_cuda_load_equals_cpu_load(key):
    config = DSV4_CONFIG if key == "deepseek_v4" else CONFIGS[key]
    sd = _checkpoint(key, config)
    cpu = create_model(config, torch.bfloat16, "cpu", sd.items())
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    gpu = create_model(config, torch.bfloat16, "cuda", sd.items())
    weights = sum(t.numel() * t.element_size() for t in (*gpu.parameters(), *gpu.buffers()))
    assert torch.cuda.max_memory_allocated() - base <= weights + (1 << 20)     # one copy, built in place
    named_cpu = dict((*cpu.named_parameters(), *cpu.named_buffers()))
    for n, t in (*gpu.named_parameters(), *gpu.named_buffers()):
        assert t.is_cuda and torch.equal(t.cpu(), named_cpu[n]), n
    ids = torch.randint(0, config["vocab_size"], (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = cpu.compute_logits(cpu(ids, torch.arange(24), None))
        b = gpu.compute_logits(gpu(ids.cuda(), torch.arange(24, device="cuda"), None)).cpu()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    assert (a - b).abs().max() < 0.1 * a.abs().max()


@cuda
def test_cuda_dummy_is_deterministic():
    a = create_model(CONFIGS["qwen3"], torch.bfloat16, "cuda", None, seed=5)
    b = create_model(CONFIGS["qwen3"], torch.bfloat16, "cuda", None, seed=5)
    assert all(p.is_cuda and torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@cuda
@pytest.mark.parametrize("kv", ["auto", "tq4"])
def test_cuda_engine_startup_budget_from_the_card(tmp_path, kv, caplog):
    from engine.engine_core import EngineCore
    path = _config_only_dir(tmp_path, CONFIGS["llama"])
    with caplog.at_level("INFO", logger="tqserve.engine"):
        core = EngineCore(EngineArgs(model=path, load_format="dummy", kv_cache_dtype=kv,
                                     gpu_memory_utilization=0.05, max_num_batched_tokens=512))
    assert core.device.type == "cuda" and core.args.dtype == "bfloat16"
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in core.model.parameters())
    assert all(t.is_cuda for t in _tensors(core.runner.kv_caches))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV budget"))
    assert "0.05 x" in line and "activation peak" in line
    total = torch.cuda.mem_get_info()[1]
    assert core.plan.total_bytes <= 0.05 * total
    fixed = EngineCore(EngineArgs(model=path, load_format="dummy", kv_cache_memory=64 << 20))
    assert fixed.plan.total_bytes <= 64 << 20
