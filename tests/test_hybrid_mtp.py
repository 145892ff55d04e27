"""Qwen3-Next / Qwen3.5 MTP head (checkpoint `mtp.*`, mtp_num_hidden_layers 1)
drafting for speculative decoding: every draft the engine proposes (the first
from the target's hidden state, then chained on the head's own output) equals
a reference built from transformers' own decoder layer and RMSNorm classes
over the whole sequence without a cache; greedy tokens and logprobs equal a
run without speculation, with chunked prefill and preemption, and with the
target's decode and verification steps replayed as (emulated) CUDA graphs;
the head's KV layer is planned into the pool; a checkpoint without the head
is refused."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_qwen3_next import make_hf
from tiny_models import token_prompts

from engine import LLM, SamplingParams

MTP = {"method": "mtp", "num_speculative_tokens": 3}


def mtp_state_dict(hf, seed=1) -> dict:
    """Random MTP tensors named as the released checkpoints name them: the
    model's (routed, where it routes) full-attention layer as mtp.layers.0,
    fc [H, 2H] and three (1 + w) norms. Every value is drawn here: a layer
    built outside its model holds uninitialised experts."""
    cfg, H = hf.config, hf.config.hidden_size
    torch.manual_seed(seed)
    full = last_full_layer(cfg)
    layer = type(hf.model.layers[full])(cfg, full).float()
    sd = {}
    for k, v in layer.state_dict().items():
        scale = 0.2 if "norm" in k else 3 * v.shape[-1] ** -0.5
        sd[f"mtp.layers.0.{k}"] = torch.randn(v.shape) * scale
    sd["mtp.fc.weight"] = torch.randn(H, 2 * H) * (2 * H) ** -0.5 * 2
    for n in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        sd[f"mtp.{n}.weight"] = torch.randn(H) * 0.2
    return sd


def add_mtp_head(path, hf, seed=1) -> dict:
    """mtp_state_dict's tensors into path's model.safetensors and
    mtp_num_hidden_layers 1 into its config."""
    sd = mtp_state_dict(hf, seed)
    w = load_file(path / "model.safetensors")
    w.update({k: v.contiguous() for k, v in sd.items()})
    save_file(w, path / "model.safetensors", metadata={"format": "pt"})
    c = json.loads((path / "config.json").read_text())
    c["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(c))
    return sd


def last_full_layer(cfg) -> int:
    """A full-attention layer whose MLP is the head's (routed where the model routes: not in mlp_only_layers)."""
    return max(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")


class ReferenceMTP:
    """The head from transformers' classes: norms (1 + w), fc over
    [embedding of token p + 1, target hidden at p], the model's full-attention
    decoder layer (causal, rotary at p), a final norm, the model's LM head."""

    def __init__(self, hf, sd):
        cfg = hf.config
        self.hf, full = hf, last_full_layer(cfg)
        self.layer = type(hf.model.layers[full])(cfg, full).float().eval()
        self.layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in sd.items() if k.startswith("mtp.layers.0.")})
        self.norms = {}
        for n in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
            self.norms[n] = type(hf.model.norm)(cfg.hidden_size, eps=cfg.rms_norm_eps).float()
            self.norms[n].weight.data.copy_(sd[f"mtp.{n}.weight"])
        self.fc = sd["mtp.fc.weight"]

    @torch.no_grad()
    def forward(self, next_ids, hidden):
        """Head outputs at positions 0..T-1 (next_ids[p]: the token after p)."""
        T = len(next_ids)
        e = self.norms["pre_fc_norm_embedding"](self.hf.model.embed_tokens(torch.tensor(next_ids)))
        x = torch.cat((e, self.norms["pre_fc_norm_hidden"](hidden)), -1) @ self.fc.t()
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        y = self.layer(x[None], position_embeddings=self.hf.model.rotary_emb(x[None], pos), attention_mask=mask,
                       position_ids=pos)
        return self.norms["norm"](y[0] if isinstance(y, torch.Tensor) else y[0][0])

    @torch.no_grad()
    def drafts(self, token_ids, k):
        """What the head drafts after the target computed token_ids[:-1]: the
        first from the target's hidden states, the rest chained on its own."""
        ids = torch.tensor([token_ids[:-1]])
        hidden = self.hf.model(input_ids=ids).last_hidden_state[0]
        nxt, out, margins = list(token_ids[1:]), [], []
        for _ in range(k):
            h = self.forward(nxt, hidden)
            logits = self.hf.lm_head(h[-1])
            top = logits.topk(2).values
            margins.append(float(top[0] - top[1]))
            out.append(int(logits.argmax()))
            hidden = torch.cat((hidden, h[-1:]))
            nxt.append(out[-1])
        return out, margins


def saved(flavour, tmp_path_factory):
    path = tmp_path_factory.mktemp(flavour)
    hf = make_hf(flavour).float()
    hf.save_pretrained(path, safe_serialization=True)
    sd = add_mtp_head(path, hf)
    return path, hf, sd


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def model(request, tmp_path_factory):
    return saved(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """One flavour, for what does not depend on the DeltaNet's projection layout."""
    return saved("qwen3_next", tmp_path_factory)


def args(**kw):
    return dict(dtype="float32", quantization="none", block_size=4, max_num_seqs=3, **kw)


def test_drafts_equal_the_reference_head(model):
    path, hf, sd = model
    llm = LLM(str(path), speculative_config=MTP, **args())
    assert llm.core.model.mtp_loaded
    seen, propose = [], llm.core.proposer.propose

    def recording(reqs, max_drafts):
        out = propose(reqs, max_drafts)
        seen.extend((list(r.token_ids), d) for r, d in zip(reqs, out) if d)
        return out

    llm.core.proposer.propose = recording
    llm.generate(token_prompts(2, 9, 20, seed=4), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    ref, compared = ReferenceMTP(hf, sd), 0
    assert len(seen) >= 6
    for token_ids, drafts in seen:
        want, margins = ref.drafts(token_ids, len(drafts))
        for got, w, m in zip(drafts, want, margins):
            if m > 1e-3:             # a near-tie may go either way at fp32 rounding
                assert got == w, (token_ids, drafts, want)
                compared += 1
            else:
                break                # later drafts chain on it
    assert compared >= 0.8 * sum(len(d) for _, d in seen)


def test_lossless_with_chunks_and_preemption(model):
    path, _, _ = model
    ps = token_prompts(5, 20, 60, seed=6)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    ref = LLM(str(path), **args()).generate(ps, sp)
    plain = LLM(str(path), **args())
    spec = LLM(str(path), speculative_config=MTP, max_num_batched_tokens=16, **args())
    small_mem = 100 * spec.core.plan.bytes_per_token + 3 * spec.core.plan.state_bytes_per_seq
    small = LLM(str(path), speculative_config=MTP, kv_cache_memory=small_mem, max_model_len=90, **args())
    for llm in (spec, small):
        out = llm.generate(ps, sp)
        for a, b in zip(ref, out):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            worst = max(abs(la[t] - lb[t]) for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs)
                        for t in la)
            # fp32 rounding of other batch shapes: on an AMD EPYC, chunking alone moves
            # this tiny random model's logprobs by 7e-5, speculation by 1.2e-4 (the
            # tokens, the lossless check, stay equal).
            assert worst < 3e-4, worst
        assert llm.core.get_stats().spec_decode_num_draft_tokens_total > 0
    assert small.core.get_stats().num_preemptions_total > 0
    # the head's attention layer is one more full-attention layer in the pool
    n_full = hf_full_layers(path)
    assert spec.core.plan.bytes_per_token * n_full == plain.core.plan.bytes_per_token * (n_full + 1)
    assert spec.core.plan.state_bytes_per_seq == 4 * plain.core.plan.state_bytes_per_seq   # k + 1 checkpoints


def test_target_steps_replayed_as_graphs(qwen3_next, monkeypatch):
    """The target's steps as CUDA graphs replay them (emulated on CPU: the
    CUDA attention path interpreted), the graph capturing the streams the
    head drafts from: verification steps of 1 + 3 rows replayed, and the
    head's chained passes (one row per sequence, padded 3 -> 4) from their
    own graphs; every draft, token and logprob the eager run's (lossless
    against no drafts: test_lossless_with_chunks_and_preemption)."""
    from model_zoo import cpu_ops
    path, _, _ = qwen3_next
    monkeypatch.setenv("TQSERVE_ATTN_BACKEND", "dense-triton")
    monkeypatch.setattr(cpu_ops, "ENABLED", False)
    ps = token_prompts(3, 9, 20, seed=4)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    runs = []
    for replay in (False, True):
        llm = LLM(str(path), speculative_config=MTP, **args())
        shapes, drafts, propose = [], [], llm.core.proposer.propose
        llm.core.proposer.propose = lambda reqs, k: (d := propose(reqs, k), drafts.append(d))[0]
        if replay:
            graphs = llm.core._capture_graphs(emulate=True)
            assert graphs.query_lens == (1, 4) and graphs.forward == llm.core.model.forward_streams
            llm.core.runner.graphs, run = graphs, graphs.run
            graphs.run = lambda b, q, *a: (shapes.append((b, q)), run(b, q, *a))[1]
            head = llm.core.runner.head_graphs = llm.core._capture_head_graphs(emulate=True)
            assert head is not None and head.forward == llm.core.model.mtp_streams
        runs.append((llm.generate(ps, sp), drafts, shapes))
    (ref, eager_drafts, _), (out, drafts, shapes) = runs
    assert drafts == eager_drafts and sum(len(d) for step in drafts for d in step) > 20
    assert shapes.count((3, 4)) >= 5
    assert head.replays >= 10         # the head's chained passes (2 per step) replayed too
    for a, b in zip(ref, out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        worst = max(abs(la[t] - lb[t]) for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs) for t in la)
        assert worst < 1e-4, worst


def hf_full_layers(path) -> int:
    return json.loads((path / "config.json").read_text())["layer_types"].count("full_attention")


def test_checkpoint_without_the_head_is_refused(model, tmp_path):
    path, hf, _ = model
    hf.save_pretrained(tmp_path, safe_serialization=True)
    c = json.loads((tmp_path / "config.json").read_text())
    c["mtp_num_hidden_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(c))
    assert LLM(str(tmp_path), **args()).core.model.has_mtp        # serves without drafting
    with pytest.raises(ValueError, match="no MTP weights"):
        LLM(str(tmp_path), speculative_config=MTP, **args())
