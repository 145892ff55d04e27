"""Which TurboQuant levers pay: perplexity with K/V round-tripped through the
codec in a plain (no-cache) forward, for configurations the engine's presets
are built from and for levers tqserve measured and left out.

Round-tripping K/V and attending over the result gives the engine's numbers
(attention over compressed blocks equals attention over the dequantized
vectors: tests/test_turboquant.py) in a fraction of the time, so this is the
tool for sweeping; kv_fidelity.py measures the shipped presets end to end.

    .venv/bin/python tests/bench/kv_levers.py --model smollm2-135m \\
        --configs k4v4+gauss,k4v4+gauss+center,k4v4+center,k3v3+center,k3v3+center+qjl

Config: k{K}v{V}[g32|g64] with K, V in 16 | 8 (int8) | 2-5 (TurboQuant), plus
  +center  keys stored minus the layer's mean key from the engine's startup
           calibration (engine/kv_calibration.py), as the engine does
  +gauss   the Gaussian Lloyd-Max codebook instead of the unit-sphere one
  +qjl     K = (K-1)-bit codes + a 1-bit QJL sign sketch of the residual
           (TurboQuant-prod: unbiased inner products, more variance)
  +sinkN   the first N tokens of every sequence kept exact (+sinkNq8: int8;
           a trailing k, e.g. +sink16q8k: keys only, values stay coded)
  +recentN  each query reads its own 16-token block and the blocks before it
           up to N tokens exact (a cache that keeps the blocks being filled
           in 16-bit and compresses a block once it is full and N tokens old);
           +recentNq8: those read int8 instead of exact (+recentNq8k: keys only)
  +selfmean  keys minus the mean of the sequence's own keys (an oracle: it
           needs the whole sequence first; measures what a better key offset
           than the calibration text's could gain)
Only layers whose cache grows with context are quantized (sliding layers
stay 16-bit, as in the engine). Writes tests/bench/results/kv_levers_MODEL.{json,md} (or --out).
"""
import argparse
import json
import math
import re
import time
from pathlib import Path

import torch

from bench_paths import DATA, OUT, log  # puts the repo on sys.path

from engine.kv_calibration import calibration_ids, key_means  # noqa: E402
from kvcache import turboquant as TQ  # noqa: E402
from kvcache.attention import Attention  # noqa: E402
from kvcache.dense_cache import expand_kv  # noqa: E402
from kvcache.kv_formats import component, layer_seed  # noqa: E402
from model_zoo.models import build_model  # noqa: E402
from model_zoo.resolve import open_model  # noqa: E402



def parse(cfg: str) -> dict:
    m = re.fullmatch(r"k(16|8|[2345])v(16|8|[234])(g32|g64)?((?:\+(?:center|gauss|qjl|selfmean|(?:sink|recent)\d+(?:q8)?k?))*)", cfg)
    if not m:
        raise SystemExit(f"bad config {cfg!r} (see the module docstring)")
    g = m.group(3) or ""
    flags = set(filter(None, m.group(4).split("+")))
    window = {}   # sink / recent: (tokens, int8 instead of exact, keys only)
    for f in flags:
        w = re.fullmatch(r"(sink|recent)(\d+)(q8)?(k)?", f)
        if w:
            window[w.group(1)] = (int(w.group(2)), bool(w.group(3)), bool(w.group(4)))
    return {"k": int(m.group(1)), "v": int(m.group(2)), "group": g,
            "sink": window.get("sink", (0, False, False)), "recent": window.get("recent", (0, False, False)),
            **{f: f in flags for f in ("center", "gauss", "qjl", "selfmean")}}


def gaussian_codebook(bits: int, group: int) -> torch.Tensor:
    return torch.tensor(TQ.lloyd_max(bits)[0], dtype=torch.float32) / math.sqrt(group)


def round_trip(x, bits, group, seed, mean, qjl, layer):
    """x [T, H, D] through the codec (16 = exact)."""
    if bits == 16:
        return x
    H, D = x.shape[1:]
    b = bits - 1 if qjl else bits
    fmt = component(str(b) + (group if b not in (8, 16) else ""))
    c = TQ.Codec(fmt, H, D, seed)
    xc = x - mean
    rec = c.dequantize(c.encode(xc))
    if qjl:   # E[S^T sign(S r)] = sqrt(2/pi) D r/|r| for Gaussian S: scale back
        S = torch.randn(D, D, generator=torch.Generator().manual_seed(1000 + layer))
        r = xc - rec
        rec = rec + math.sqrt(math.pi / 2) / D * r.norm(dim=-1, keepdim=True) * (torch.sign(r @ S.T) @ S)
    return rec + mean


def recent_exact(attn, q, exact, coded, recent, bs=16):
    """Causal attention where key j is read exact for query p when j's block
    is among the recent // bs blocks ending at p's own, coded otherwise."""
    T, Hq, _ = q.shape
    blk = torch.arange(T) // bs
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    near = blk[None, :] > blk[:, None] - recent // bs
    (k, v), (kq, vq) = [[expand_kv(x, Hq).float().transpose(0, 1) for x in kv] for kv in (exact, coded)]
    qt = q.float().transpose(0, 1) * attn.scale
    s = torch.where(near, qt @ k.transpose(1, 2), qt @ kq.transpose(1, 2)).masked_fill(~causal, float("-inf"))
    p = torch.softmax(s, -1)
    o = (p * near) @ v + (p * ~near) @ vq
    return o.transpose(0, 1).to(q.dtype)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--configs", required=True)
    ap.add_argument("--num-seqs", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--out", default=None, help="results path without suffix (default results/kv_levers_MODEL)")
    a = ap.parse_args()
    configs = a.configs.split(",")
    cfgs = [parse(c) for c in configs]
    src = open_model(a.model)
    model = build_model(src.config)
    model.load_weights(src.weights())
    model.eval()
    ids = src.tokenizer.encode(DATA.read_text()[: a.num_seqs * a.seq_len * 8])
    wins = [ids[i * a.seq_len:(i + 1) * a.seq_len] for i in range(a.num_seqs)]
    means = key_means(model, calibration_ids(src.tokenizer, 0))
    state = {"cfg": None}
    plain = Attention._no_cache
    orig_codebook = TQ._codebook

    def no_cache(self, q, k, v):
        c = state["cfg"]
        if c is not None and self.sliding_window is None:
            i = self.layer_idx
            mu = means[i] if c["center"] else torch.zeros_like(means[i])
            if c["selfmean"]:
                mu = k.float().mean(0)
            kq = round_trip(k, c["k"], c["group"], layer_seed(0, i), mu, c["qjl"], i)
            vq = round_trip(v, c["v"], c["group"], layer_seed(0, i), torch.zeros_like(mu), False, i)
            k8, v8 = round_trip(k, 8, "", 0, mu, False, i), round_trip(v, 8, "", 0, 0, False, i)
            n, q8, k_only = c["sink"]
            if n:
                ks, vs = (k8, v8) if q8 else (k, v)
                kq = torch.cat([ks[:n], kq[n:]])
                vq = vq if k_only else torch.cat([vs[:n], vq[n:]])
            n, q8, k_only = c["recent"]
            if n:
                ke, ve = (k8, v8) if q8 else (k, v)
                return recent_exact(self, q, (ke, vq if k_only else ve), (kq, vq), n)
            k, v = kq, vq
        return plain(self, q, k, v)

    @torch.no_grad()
    def ppl() -> float:
        nll, n = 0.0, 0
        for w in wins:
            t = torch.tensor(w)
            lp = torch.log_softmax(model.compute_logits(model(t, torch.arange(len(w)), None)).float(), -1)
            nll -= float(lp[:-1].gather(1, t[1:, None]).sum())
            n += len(w) - 1
        return math.exp(nll / n)

    Attention._no_cache = no_cache
    try:
        base = ppl()
        log(f"{a.model} f16 (exact K/V): ppl {base:.4f}")
        rows = [{"config": "exact", "ppl": base, "delta_pct": 0.0}]
        for name, c in zip(configs, cfgs):
            state["cfg"] = c
            TQ._codebook = gaussian_codebook if c["gauss"] else orig_codebook
            t0 = time.time()
            p = ppl()
            rows.append({"config": name, "ppl": p, "delta_pct": 100 * (p / base - 1)})
            log(f"{a.model} {name}: ppl {p:.4f} ({rows[-1]['delta_pct']:+.2f}%, {time.time() - t0:.0f}s)")
    finally:
        Attention._no_cache = plain
        TQ._codebook = orig_codebook
    date = time.strftime("%Y-%m-%d %H:%M")
    out = Path(a.out) if a.out else OUT / f"kv_levers_{a.model}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"model": a.model, "num_seqs": a.num_seqs,
                                                    "seq_len": a.seq_len, "date": date, "rows": rows}, indent=1))
    lines = [f"# KV levers, {a.model}: {a.num_seqs} x {a.seq_len} tokens of tinyshakespeare ({date})", "",
             "K/V round-tripped through the codec in a no-cache forward (tests/bench/kv_levers.py).", "",
             "| config | PPL | delta vs exact |", "|---|---|---|"]
    lines += [f"| {r['config']} | {r['ppl']:.4f} | {r['delta_pct']:+.2f}% |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
