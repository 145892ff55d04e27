"""`--quantization gguf`: the GGUF file's quantized weights stay in their
blocks (parallel/quant/base.py GGUFBlocks), on the two real models (SmolLM2
Q4_1 + a Q8_0 embedding; Gemma3 Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0):

  - every layer fed by a quantized tensor holds the file's bytes, so its
    resident bytes per parameter are the format's (Q4_1 0.625, Q8_0 1.0625,
    Q4_K 0.5625, Q6_K 0.8203125, ...), and the model's resident total is
    measured from its tensors;
  - prompt logprobs equal the dequantized-dense model's (the same
    dequantization, one layer at a time into a shared buffer) and greedy
    tokens are identical for 32 tokens;
  - loading never holds more than the resident model plus one layer
    (anonymous memory sampled while a fresh process loads).
"""
import json
import subprocess
import sys

import pytest
import torch
from fixtures_models import REAL_MODELS, REPO

from engine import LLM, SamplingParams
from parallel.quant.base import GGUFBlocks
from parallel.quant.gguf import QTYPES, row_bytes

# Two prompts in one batch: a CPU step dequantizes every layer once whatever the batch.
PROMPTS = ["The capital of France is", "def add(a, b):\n    return"]
ARGS = dict(kv_cache_memory=32 << 20, max_model_len=256, dtype="float32")


@pytest.fixture(scope="module", params=REAL_MODELS)
def pair(request):
    dense = LLM(request.param, quantization="none", **ARGS)
    blocks = LLM(request.param, quantization="gguf", **ARGS)
    return request.param, dense, blocks


def layers(llm):
    return {n: m for n, m in llm.core.model.named_modules() if isinstance(getattr(m, "quant", None), GGUFBlocks)}


def test_layers_hold_the_files_bytes(pair):
    name, dense, blocks = pair
    held = layers(blocks)
    assert held, "no layer kept its GGUF blocks"
    fmts = set()
    for n, m in held.items():
        q = m.quant
        for s in q.shards.values():
            assert s.fmt in QTYPES, (n, s.fmt)        # every shard of these two files is a kernel type
            fmts.add(s.fmt)
            assert s.data.dtype == torch.uint8 and s.data.shape == (s.rows, row_bytes(s.fmt, q.k))
            bpp = s.data.numel() / (s.rows * q.k)
            assert bpp == QTYPES[s.fmt].type_size / QTYPES[s.fmt].block, (n, s.fmt, bpp)
        assert m.weight.numel() == 0                     # no dense copy beside the blocks
        fmts_in_order = [s.fmt for s in q.shards.values()]
        # neighbouring shards of one type were joined (q, k, v in one GEMV call)
        assert all(a != b for a, b in zip(fmts_in_order, fmts_in_order[1:])), (n, fmts_in_order)
    dense_bytes = sum(p.numel() * 4 for p in dense.core.model.parameters())
    resident = blocks.core.resident_bytes
    print(f"{name}: formats {sorted(fmts)}; resident {resident / 2**20:.1f} MiB vs fp32 {dense_bytes / 2**20:.1f} MiB")
    assert fmts >= ({"Q4_1", "Q8_0"} if name == "smollm2-135m" else {"Q4_K", "Q6_K", "Q8_0"})
    assert resident < 0.4 * dense_bytes


def test_logprobs_and_greedy_tokens_equal_the_dense_model(pair):
    name, dense, blocks = pair
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    a, b = dense.generate(PROMPTS, sp), blocks.generate(PROMPTS, sp)
    worst = 0.0
    for x, y in zip(a, b):
        assert list(x.outputs[0].token_ids) == list(y.outputs[0].token_ids), name
        for p, q in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            worst = max(worst, max(abs(lp - q[t]) for t, lp in p.items()))
    print(f"{name}: greedy tokens identical, worst prompt logprob difference {worst:.2e}")
    assert worst < 1e-4


PEAK = r"""
import json, sys, threading, time, torch
from model_zoo.gguf_file import GGUFFile
from engine.engine_args import EngineArgs
from model_zoo.models import create_model, resident_bytes
from model_zoo.resolve import open_model

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

src = open_model(sys.argv[1])
# One layer: the largest tensor of the file in fp32 (what a dense load holds at once).
largest = max(int(t.n_elements) * 4 for t in GGUFFile(src.path).tensors)
torch.set_num_threads(1)
peak, stop = [anon()], threading.Event()
base = peak[0]
def watch():
    while not stop.is_set():
        peak[0] = max(peak[0], anon()); time.sleep(0.002)
t = threading.Thread(target=watch); t.start()
m = create_model(src.config, torch.float32, "cpu", src.weights(stored=True), stored=src.stored)
stop.set(); t.join()
print(json.dumps({"peak": max(peak[0], anon()) - base, "resident": resident_bytes(m), "layer": largest}))
"""


@pytest.mark.parametrize("model", REAL_MODELS)
def test_loading_holds_the_resident_model_plus_one_layer(model):
    out = subprocess.run([sys.executable, "-c", PEAK, model], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{model}: peak anonymous memory during load {r['peak'] / 2**20:.1f} MiB, "
          f"resident {r['resident'] / 2**20:.1f} MiB, largest tensor in fp32 {r['layer'] / 2**20:.1f} MiB")
    assert r["peak"] <= r["resident"] + r["layer"] + (48 << 20), r
