"""LoRA adapters on CUDA: eager steps (rows grouped per slot) and captured
decode steps (the Triton shrink / expand kernels, parallel/lora_triton.py)
against transformers with each adapter merged into its weights (W + s B A)
on the same GPU. No peft on a bare GPU machine: the adapters are written in
PEFT's file format here (tests/test_lora.py checks the format against peft).
Skipped, with the reason printed, without a CUDA device.
"""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: torch.cuda.is_available() is False")

from engine import LLM, LoRARequest, SamplingParams  # noqa: E402
from test_model_parity import CONFIGS, make_hf_model  # noqa: E402
from tiny_models import peft_tensors, random_lora, write_peft  # noqa: E402

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(hf, path, r: int, alpha: float, targets, seed: int) -> dict:
    """A random adapter in PEFT's files; returns {module name: (A, B, scale)}."""
    names = [f"model.layers.{i}.{TARGETS[proj]}.{proj}" for i in range(hf.config.num_hidden_layers)
             for proj in targets]
    parts = random_lora({n: tuple(hf.get_submodule(n).weight.shape) for n in names}, r, seed, b_scale=0.5)
    write_peft(path, peft_tensors(parts), r=r, lora_alpha=alpha, target_modules=list(targets))
    return {n: (a, b, alpha / r) for n, (a, b) in parts.items()}


def merged_logprobs(hf, parts, ids: list[int]) -> torch.Tensor:
    """log-softmax of transformers' logits with the adapter merged in (fp32, CUDA)."""
    saved = {}
    with torch.no_grad():
        for name, (a, b, s) in parts.items():
            w = hf.get_submodule(name).weight
            saved[name] = w.detach().clone()
            w += s * (b.to(w) @ a.to(w))
        try:
            return torch.log_softmax(hf(input_ids=torch.tensor([ids], device="cuda")).logits[0].float(), -1)
        finally:
            for name, w in saved.items():
                hf.get_submodule(name).weight.copy_(w)


def test_adapters_eager_and_captured_match_merged_weights(tmp_path):
    hf = make_hf_model(CONFIGS["llama"])
    hf.save_pretrained(tmp_path / "model")
    adapters = {"a": write_adapter(hf, tmp_path / "a", 8, 16, list(TARGETS), 1),
                "b": write_adapter(hf, tmp_path / "b", 4, 4, ["q_proj", "v_proj", "down_proj"], 2)}
    hf = hf.to("cuda", torch.float32)
    loras = {n: LoRARequest(n, i + 1, str(tmp_path / n)) for i, n in enumerate(adapters)}
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(3, CONFIGS["llama"]["vocab_size"], (n,), generator=g).tolist() for n in (23, 41, 17, 30, 9)]
    picks = ["a", None, "b", "a", None]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    results = {}
    for eager in (True, False):
        llm = LLM(str(tmp_path / "model"), device="cuda", dtype="float32", enforce_eager=eager, enable_lora=True,
                  max_loras=2)
        outs = llm.generate(ps, sp, lora_request=[loras[p] if p else None for p in picks])
        if not eager:
            assert llm.core.graphs is not None and llm.core.graphs.replays > 0
        worst = 0.0
        for o, p in zip(outs, picks):
            ids = o.prompt_token_ids + o.outputs[0].token_ids
            ref = merged_logprobs(hf, adapters[p] if p else {}, ids)
            for j, t in enumerate(o.outputs[0].token_ids):
                pos = len(o.prompt_token_ids) - 1 + j
                assert t == int(ref[pos].argmax()), (p, j)
                worst = max(worst, abs(o.outputs[0].logprobs[j][t] - ref[pos, t].item()))
            for q, lp in enumerate(o.prompt_logprobs[1:], 1):
                worst = max(worst, abs(lp[ids[q]] - ref[q - 1, ids[q]].item()))
        print(f"LoRA on cuda, {'eager' if eager else 'CUDA graphs'}: max |logprob diff| vs merged weights {worst:.2e}")
        assert worst < 2e-3, worst
        results[eager] = [o.outputs[0].token_ids for o in outs]
        del llm
    assert results[True] == results[False]
