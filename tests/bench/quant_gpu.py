"""Quantized-weight kernels on a GPU: time, bandwidth and error next to bf16
cuBLAS and the weight-bytes roofline (issue 15).

    python tests/bench/quant_gpu.py [--formats Q4_K,MXFP4,...] [--ms 1,16,2048] [--iters 30]
    python tests/bench/quant_gpu.py --device cpu --tiny      # the script's own check, < 2 min on a CPU

Kernels (Triton; x bf16 activations, fp32 accumulation):
  GGUF   parallel/quant/gguf.matmul, Q8_0 Q4_0 Q4_1 Q5_0 Q4_K Q5_K Q6_K (GEMV for M <= 16,
         tl.dot GEMM above), on Llama-3-8B layer shapes N x K: q/o 4096x4096, k/v 1024x4096,
         gate/up 14336x4096, down 4096x14336;
  FP8    parallel/quant/fp8_block.matmul (e4m3, fp32 128x128 block scales), DeepSeek-V4-Flash at
         TP=2 (server/plan.py's built-in config): q_b 16384x1024, o_b 4096x4096;
  MXFP4  parallel/quant/mxfp4.matmul (e2m1 + E8M0 per 32), one routed expert: w13 4096x4096,
         w2 4096x2048;
  MoE    parallel/quant/moe.moe_forward "mxfp4", rank 0's 128 experts at TP=2: M tokens routed
         top-6 of 256 (sqrt-softplus scores of random logits plus a fixed per-expert bias of
         std 0.05: an uneven load, at M = 2048 ~6.2K local pairs, every expert active, the
         busiest ~2.5x the mean), the pairs on the other rank dropped (-1);
  MoE-GGUF  moe_forward "gguf" on Qwen3-30B-A3B's experts (128, top-8, H 2048, I 768, one
         GPU), as Q4_K_M files keep them: gate / up Q4_K, down Q6_K (the grouped kernels
         dequantize GGUF tiles in registers);
for M = 1, 16, 2048 tokens.

Per case: the kernel's time (CUDA events around each call, a 256 MiB write
before each to flush L2 -- it also lets the host queue the call ahead, so the
events see GPU time; warm-up, median of --iters), next to bf16 F.linear
(cuBLAS) on the same shape and dequantized weight, and the roofline: the
quantized weight bytes over the card's copy bandwidth (a 2 GiB
device-to-device copy in the same run, reads + writes counted, as
gpu_engine.py). Reported: achieved GB/s of quantized bytes, % of the copy
bandwidth, TFLOP/s, and the max relative error (max |y - ref| / max |ref|)
against the torch reference: dequantize to fp32 + F.linear in fp32 (for the
MoE: moe_forward's torch path in fp32). MoE times: "kernels" = the two
grouped launches with the routing precomputed (what the roofline and the
target compare), "call" = the whole moe_forward (routing included, no host
sync); its baseline is the per-expert bf16 cuBLAS loop of
Experts.forward, captured in a CUDA graph (no launch overhead), plus the
same grouped Triton kernels on bf16 weights.

Targets (issue 15), printed pass / miss: 4-bit formats (Q4_0, Q4_1, Q4_K,
MXFP4, the MoE) at M = 1 >= 60% of the copy bandwidth on their quantized
bytes; at M = 2048, time <= 1.3x bf16 cuBLAS.

Writes tests/bench/results/quant_gpu.{json,md} (or --out STEM) after every
case: GPU, torch / triton / CUDA versions, commit, the command. --budget-s
skips what is left once it is spent (recorded as skipped). Runs on a bare
GPU machine (torch, triton; no gguf: the blocks are random bytes with sane
fp16 scales written at their offsets, as tests/test_quant_gguf.py does).

--device cpu --tiny: tiny shapes under TRITON_INTERPRET=1 on CPU tensors
(fp16 activations: the interpreter's tl.dot mishandles bf16), written to a
scratch path (tempdir/quant_gpu_tiny.*) and marked as an interpreter run:
its numbers are not GPU measurements.
"""
import argparse
import os
import shlex
import sys
import tempfile
import time
import traceback
import zlib


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (implied by --device cpu)")
    ap.add_argument("--formats", default="Q4_K,Q4_0,MXFP4,MOE,MOE-GGUF,FP8,Q8_0,Q6_K,Q5_K,Q4_1,Q5_0",
                    help="comma list of GGUF types, FP8, MXFP4, MOE (run in this order)")
    ap.add_argument("--ms", default=None, help="token counts (default 1,16,2048; --tiny 1,16,32)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per case (default 30; --tiny 2)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip the remaining cases after this many seconds (default 240; --tiny 150)")
    ap.add_argument("--out", default=None, help="results stem (default tests/bench/results/quant_gpu; "
                                                "--tiny: <tempdir>/quant_gpu_tiny)")
    a = ap.parse_args(argv)
    if a.device == "cpu":
        a.tiny = True
    return a


ARGS = parse_args() if __name__ == "__main__" else None
# The interpreter is chosen when triton is first imported: set it before anything imports it.
if ARGS is not None:
    os.environ["TRITON_INTERPRET"] = "1" if ARGS.device == "cpu" else "0"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_paths import OUT, log  # noqa: E402  (puts the repo on sys.path)

FOUR_BIT = {"Q4_0", "Q4_1", "Q4_K", "MXFP4", "MOE"}
GEMV_TARGET = 0.60          # of the copy bandwidth, M = 1, 4-bit formats
GEMM_TARGET = 1.30          # x bf16 cuBLAS time at the largest M
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
              "Q6_K": (208,)}   # byte offsets of a block's fp16 d (and m / dmin)

LLAMA = [("q/o_proj", 4096, 4096), ("k/v_proj", 1024, 4096), ("gate/up_proj", 14336, 4096),
         ("down_proj", 4096, 14336)]
LLAMA_TINY = [("q/o_proj", 64, 256), ("k/v_proj", 16, 256), ("gate/up_proj", 96, 256), ("down_proj", 64, 512)]


def dsv4_shapes(tiny: bool, tp: int = 2) -> dict:
    """DeepSeek-V4-Flash per-rank shapes at TP=tp from server/plan.py's built-in config."""
    if tiny:
        return {"fp8": [("q_b_proj", 256, 128), ("o_b_proj", 128, 256)],
                "fp4": [("expert w13", 128, 128), ("expert w2", 128, 64)],
                "moe": dict(E=8, E_local=4, top_k=2, H=128, I=64, limit=10.0, scaling=1.5)}
    from server.plan import load_config
    _, c = load_config("deepseek-v4-flash")
    H, I, E = c["hidden_size"], c["moe_intermediate_size"], c["n_routed_experts"]
    nh, D = c["num_attention_heads"], c["head_dim"]
    return {"fp8": [("q_b_proj", nh * D // tp, c["q_lora_rank"]),                 # column-parallel
                    ("o_b_proj", H, c["o_groups"] * c["o_lora_rank"] // tp)],      # row-parallel
            "fp4": [("expert w13", 2 * I, H), ("expert w2", H, I)],
            "moe": dict(E=E, E_local=E // tp, top_k=c["num_experts_per_tok"], H=H, I=I,
                        limit=float(c.get("swiglu_limit", 10.0)), scaling=float(c.get("routed_scaling_factor", 1.5)))}


# ---------------------------------------------------------------- timing
class Timer:
    def __init__(self, device, iters, warmup):
        self.cuda = device == "cuda"
        self.iters, self.warmup = iters, warmup
        # Written before every timed call: evicts L2 (50 MiB on an H200) and gives the host time to queue.
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if self.cuda else None

    def __call__(self, fn) -> float:
        """Median microseconds of fn() over self.iters calls, after self.warmup."""
        for _ in range(self.warmup):
            fn()
        if not self.cuda:
            ts = []
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e6)
            return sorted(ts)[len(ts) // 2]
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.iters)]
        for s, e in ev:
            self.flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        ts = sorted(s.elapsed_time(e) * 1e3 for s, e in ev)
        return ts[len(ts) // 2]


def copy_bandwidth(device: str, nbytes: int, iters: int = 10) -> dict:
    """GB/s of a device-to-device copy, reads + writes counted (median and best of iters)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ts = []
    for i in range(iters + 3):
        if device == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(src)
            e.record()
            e.synchronize()
            dt = s.elapsed_time(e) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            dt = time.perf_counter() - t0
        if i >= 3:
            ts.append(dt)
    del src, dst
    ts.sort()
    return {"bytes": nbytes, "gb_s": 2 * nbytes / ts[len(ts) // 2] / 1e9, "gb_s_best": 2 * nbytes / ts[0] / 1e9}


def rel_err(y, ref) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------- weights
def gguf_weight(name, N, K, g, device, amp=0.05):
    """uint8 [N, row_bytes]: random bytes, each block's fp16 fields set to uniform(-amp, amp)."""
    from parallel.quant.gguf import QTYPES, row_bytes
    t = QTYPES[name]
    nb = K // t.block
    raw = torch.randint(0, 256, (N, row_bytes(name, K)), dtype=torch.uint8, device=device, generator=g)
    blocks = raw.view(N, nb, t.type_size)
    for off in F16_FIELDS[name]:
        f = ((torch.rand(N, nb, device=device, generator=g) * 2 - 1) * amp).half()
        blocks[..., off:off + 2] = f.view(torch.uint8).view(N, nb, 2)
    return raw


def fp8_weight(N, K, g, device):
    w8 = (torch.randn(N, K, device=device, generator=g) * 3).to(torch.float8_e4m3fn)
    s = torch.rand(-(-N // 128), -(-K // 128), device=device, generator=g) * 0.02 + 0.001
    return w8, s


def fp4_weight(lead, N, K, g, device):
    """Packed e2m1 codes (random bytes: two random codes each) and E8M0 scales 2^-7..2^0 as uint8."""
    packed = torch.randint(0, 256, (*lead, N, K // 2), dtype=torch.uint8, device=device, generator=g)
    scales = torch.randint(120, 128, (*lead, N, K // 32), dtype=torch.uint8, device=device, generator=g)
    return packed, scales


# ---------------------------------------------------------------- cases
def target_of(fmt, M, ms, pct, ratio):
    if M == 1 and fmt in FOUR_BIT and pct is not None:
        return f"GEMV >= {GEMV_TARGET:.0%} copy BW", pct >= GEMV_TARGET
    if M == max(ms) and M > 16 and ratio is not None:
        return f"<= {GEMM_TARGET}x bf16 cuBLAS", ratio <= GEMM_TARGET
    return None, None


def finish(row, ctx, weight_bytes, params, flops, t_us, t_dense):
    """Derived columns: bandwidth against the copy bandwidth, ratio to cuBLAS, target verdict."""
    bw = ctx["copy_gb_s"]
    row.update(weight_bytes=weight_bytes, bits_per_weight=round(8 * weight_bytes / params, 3),
               kernel_us=round(t_us, 2), dense_us=round(t_dense, 2) if t_dense else None,
               x_dense=round(t_us / t_dense, 3) if t_dense else None,
               roofline_us=round(weight_bytes / (bw * 1e9) * 1e6, 2),
               GBps=round(weight_bytes / t_us / 1e3, 1), pct_copy_bw=round(weight_bytes / t_us / 1e3 / bw, 4),
               TFLOPs=round(flops / t_us / 1e6, 3))
    row["target"], row["target_pass"] = target_of(row["format"], row["M"], ctx["ms"], row["pct_copy_bw"],
                                                  row["x_dense"])
    return row


def linear_case(ctx, fmt, model, layer, N, K, M, nbytes, ref_w, wd, call):
    """One (weight, M): the kernel vs F.linear on the dequantized weight (wd, the activations'
    dtype; its time cached per shape), errors against fp32."""
    dev, dt, timer = ctx["device"], ctx["dtype"], ctx["timer"]
    g = torch.Generator(device=dev).manual_seed(1000 + M)
    x = torch.randn(M, K, device=dev, generator=g).to(dt)
    ref = F.linear(x.float(), ref_w)
    err = rel_err(call(x), ref)
    dense_err = rel_err(F.linear(x, wd), ref)
    t = timer(lambda: call(x))
    key = (N, K, M)
    if key not in ctx["dense_cache"]:
        ctx["dense_cache"][key] = timer(lambda: F.linear(x, wd))
    row = {"kind": "linear", "format": fmt, "model": model, "layer": layer, "N": N, "K": K, "M": M,
           "max_rel_err": err, "dense_max_rel_err": dense_err, "correct": bool(err < ctx["tol"])}
    return finish(row, ctx, nbytes, N * K, 2 * M * N * K, t, ctx["dense_cache"][key])


def linear_group(ctx, fmt, model, layer, N, K):
    """Weights for one (format, shape); yields a case per M."""
    dev = ctx["device"]
    g = torch.Generator(device=dev).manual_seed(zlib.crc32(f"{fmt} {N} {K}".encode()))
    if fmt == "FP8":
        from parallel.quant import fp8_block
        w8, s = fp8_weight(N, K, g, dev)
        nbytes = w8.nbytes + s.nbytes
        ref_w = fp8_block.dequantize(w8, s, torch.float32)
        call = lambda x: fp8_block.matmul(x, w8, s, backend="triton")  # noqa: E731
    elif fmt == "MXFP4":
        from parallel.quant import mxfp4
        p, s = fp4_weight((), N, K, g, dev)
        nbytes = p.nbytes + s.nbytes
        ref_w = mxfp4.dequantize(p, s, torch.float32)
        call = lambda x: mxfp4.matmul(x, p, s, backend="triton")  # noqa: E731
    else:
        from parallel.quant import gguf
        raw = gguf_weight(fmt, N, K, g, dev)
        nbytes = raw.nbytes
        ref_w = gguf.dequantize(raw, fmt, K, torch.float32)
        call = lambda x: gguf.matmul(x, raw, fmt, K, backend="triton")  # noqa: E731
    wd = ref_w.to(ctx["dtype"])
    for M in ctx["ms"]:
        yield M, lambda M=M: linear_case(ctx, fmt, model, layer, N, K, M, nbytes, ref_w, wd, call)


def route(T, cfg, g, device, dtype):
    """Top-k of sqrt-softplus scores (random logits + a per-expert bias: uneven load), normalized
    and scaled as model_zoo.deepseek_v4.Router; rank 0's local ids, -1 for the other ranks';
    the weights in the activations' dtype (the router's scores are)."""
    E, k, EL = cfg["E"], cfg["top_k"], cfg["E_local"]
    bias = torch.randn(E, device=device, generator=torch.Generator(device=device).manual_seed(7)) * 0.05
    scores = F.softplus(torch.randn(T, E, device=device, generator=g)).sqrt()
    idx = torch.topk(scores + bias, k, dim=-1, sorted=False).indices
    w = scores.gather(1, idx)
    w = w / w.sum(-1, keepdim=True) * cfg["scaling"]
    return torch.where(idx < EL, idx, -1), w.to(dtype)


def qwen3_moe_shapes(tiny: bool) -> dict:
    """Qwen3-30B-A3B's experts (one GPU: all local), as Q4_K_M files keep them: gate / up Q4_K, down Q6_K."""
    if tiny:
        return dict(E=8, E_local=8, top_k=2, H=256, I=256, limit=float("inf"), scaling=1.0)
    return dict(E=128, E_local=128, top_k=8, H=2048, I=768, limit=float("inf"), scaling=1.0)


def moe_weights(fmt, cfg, g, dev, dt):
    """(w13, w2 in moe_forward's layout for fmt, bytes per expert, dense W13 [EL, 2I, H], W2 [EL, H, I])."""
    from parallel.quant import gguf, mxfp4
    EL, H, I = cfg["E_local"], cfg["H"], cfg["I"]
    if fmt == "mxfp4":
        w13 = fp4_weight((EL,), 2 * I, H, g, dev)
        w2 = fp4_weight((EL,), H, I, g, dev)
        per_expert = sum(t[0].nbytes + t[1].nbytes for t in (w13, w2)) // EL
        return w13, w2, per_expert, mxfp4.dequantize(*w13, dt), mxfp4.dequantize(*w2, dt)
    # Small scales (weights ~1e-2, as in real checkpoints): the unclamped SwiGLU would otherwise
    # overflow fp16 activations in the interpreter check.
    gate, up, down = (gguf_weight(n, EL * r, k, g, dev, amp=1e-3).view(EL, r, -1)
                      for n, r, k in (("Q4_K", I, H), ("Q4_K", I, H), ("Q6_K", H, I)))
    deq = lambda t, name, k: gguf.dequantize(t.reshape(-1, t.shape[-1]), name, k, dt).view(EL, -1, k)  # noqa: E731
    W13 = torch.cat((deq(gate, "Q4_K", H), deq(up, "Q4_K", H)), dim=1)
    return (((gate, "Q4_K"), (up, "Q4_K"), H), ((down, "Q6_K"), I), (gate.nbytes + up.nbytes + down.nbytes) // EL,
            W13, deq(down, "Q6_K", I))


def moe_group(ctx, cfg, fmt="mxfp4", model="DeepSeek-V4-Flash TP=2 rank 0"):
    """rank 0's experts in fmt (mxfp4, or gguf: Q4_K_M's types); yields a case per M (tokens)."""
    from parallel.quant import moe
    dev, dt, timer = ctx["device"], ctx["dtype"], ctx["timer"]
    EL, H, I, lim = cfg["E_local"], cfg["H"], cfg["I"], cfg["limit"]
    g = torch.Generator(device=dev).manual_seed(11)
    w13, w2, per_expert, W13, W2 = moe_weights(fmt, cfg, g, dev, dt)   # W13 [EL, 2I, H]: the bf16 baseline's

    def case(M):
        for seed in range(2000 + M, 2100 + M):     # a batch with at least one pair on this rank
            gm = torch.Generator(device=dev).manual_seed(seed)
            x = torch.randn(M, H, device=dev, generator=gm).to(dt)
            idx, w = route(M, cfg, gm, dev, dt)
            if bool((idx >= 0).any()):
                break
        else:
            raise RuntimeError(f"no routing of {M} tokens with a pair on rank 0 in 100 seeds")
        ref = moe.moe_forward(x.float(), idx, w, w13, w2, fmt, lim, backend="torch")
        order, counts, starts, ends = moe.route(idx, EL)
        cl = counts.tolist()
        active = sum(c > 0 for c in cl)
        kern = lambda: moe._moe_triton(x, idx, w, w13, w2, fmt, lim, EL, I, H,  # noqa: E731
                                       order, counts, starts, ends)
        full = lambda: moe.moe_forward(x, idx, w, w13, w2, fmt, lim, backend="triton")  # noqa: E731
        err = rel_err(kern(), ref)
        err_call = rel_err(full(), ref)
        t_kern, t_call = timer(kern), timer(full)
        # bf16 baselines: Experts.forward's per-expert cuBLAS loop (routing precomputed; in a
        # CUDA graph on a GPU: no launch overhead), and the grouped Triton kernels on bf16 weights.
        k = idx.shape[1]
        wflat = w.reshape(-1)
        plan, s0 = [], 0
        for e, c in enumerate(cl):
            if c:
                pairs = order[s0:s0 + c]
                plan.append((e, pairs // k, pairs))
                s0 += c

        def loop():
            out = torch.zeros_like(x)
            for e, tok, pairs in plan:
                gg, u = F.linear(x[tok], W13[e]).chunk(2, dim=-1)
                h = F.silu(gg.clamp(max=lim)) * u.clamp(min=-lim, max=lim)
                out.index_add_(0, tok, F.linear(h, W2[e]) * wflat[pairs, None])
            return out
        dense_fn, graphed = loop, False
        if ctx["device"] == "cuda":
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        loop()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    graph_out = loop()
                dense_fn, graphed = graph.replay, True
            except Exception as e:              # eager loop then (launch-bound at large M)
                log(f"   MoE bf16 loop: no CUDA graph ({type(e).__name__}: {e}); eager")
        dense_fn()
        dense_err = rel_err(graph_out if graphed else loop(), ref)
        t_dense = timer(dense_fn)
        bf16_grouped = lambda: moe._moe_triton(x, idx, w, W13, W2, "bf16", lim, EL, I, H,  # noqa: E731
                                               order, counts, starts, ends)
        t_grouped = timer(bf16_grouped)
        pairs_local = sum(cl)
        row = {"kind": "moe", "format": "MOE" if fmt == "mxfp4" else "MOE-GGUF", "model": model,
               "layer": f"{EL} experts {'MXFP4' if fmt == 'mxfp4' else 'Q4_K gate/up, Q6_K down'}, "
                        f"top-{cfg['top_k']} of {cfg['E']}", "N": 2 * I, "K": H, "I": I, "M": M,
               "local_pairs": pairs_local, "active_experts": active, "seed": seed, "max_rows_per_expert": max(cl),
               "call_us": round(t_call, 2), "bf16_grouped_triton_us": round(t_grouped, 2),
               "dense_kind": "bf16 cuBLAS per expert, " + ("CUDA graph" if graphed else "eager"),
               "max_rel_err": err, "call_max_rel_err": err_call, "dense_max_rel_err": dense_err,
               "correct": bool(max(err, err_call) < ctx["tol"])}
        # weights read: the active experts' w13 + w2 (3IH parameters each); FLOPs: 2 * pairs * 3IH
        finish(row, ctx, active * per_expert, active * 3 * I * H, 2 * pairs_local * 3 * I * H, t_kern, t_dense)
        if graphed:
            del graph
        return row

    for M in ctx["ms"]:
        yield M, lambda M=M: case(M)


# ---------------------------------------------------------------- report
def machine(device: str) -> dict:
    import subprocess
    from bench_paths import ROOT
    info = {"device": device, "torch": torch.__version__, "triton_interpret": os.environ.get("TRITON_INTERPRET")}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1),
                    l2_mib=round(getattr(p, "L2_cache_size", 0) / 2**20, 1), cuda=torch.version.cuda)
    else:
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
        info.update(cpu=cpu, threads=torch.get_num_threads())
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
    except Exception:
        info["commit"] = None
    return info


INTERP_BANNER = ("**INTERPRETER RUN (TRITON_INTERPRET=1 on CPU tensors, tiny shapes): a check of the script, "
                 "NOT a GPU measurement. Every time, bandwidth, ratio and pass / miss below is meaningless.**")


def _f(x, fmt="{:.1f}"):
    return fmt.format(x) if isinstance(x, (int, float)) and x is not None else "-"


def _target(r):
    if r.get("target") is None:
        return "-"
    return f"{r['target']}: {'pass' if r['target_pass'] else '**miss**'}"


def _err(r):
    s = f"{r['max_rel_err']:.1e}"
    return s if r["correct"] else f"**{s} WRONG**"


def markdown(res) -> str:
    m = res["machine"]
    head = (f"{m['gpu']}, sm_{m['capability'].replace('.', '')}, {m['sms']} SMs, L2 {m['l2_mib']} MiB"
            if m.get("gpu") else f"CPU {m.get('cpu')}")
    bw = res["copy_bandwidth"]
    rows = res["results"]
    lines = [f"# Quantized-weight kernels ({head})", ""]
    if res["interpreter"]:
        lines += [INTERP_BANNER, ""]
    lines += [f"`{res['command']}`", "",
              f"torch {m['torch']}, triton {m.get('triton')}, CUDA {m.get('cuda')}, commit {m.get('commit')}; "
              f"copy bandwidth {bw['gb_s']:.0f} GB/s (median; best {bw['gb_s_best']:.0f}; "
              f"{bw['bytes'] / 2**30:.2f} GiB device-to-device copy, reads + writes). Activations "
              f"{res['dtype']}. Times: median of {res['iters']} calls, "
              + ("CUDA events, L2 flushed (256 MiB write) before each. " if m["device"] == "cuda"
                 else "perf_counter (CPU, interpreter). ") +
              "cuBLAS = F.linear on the dequantized weight in the activations' dtype, same shape. Roofline = "
              "quantized weight bytes / copy bandwidth; GB/s = quantized bytes / kernel time; rel err = "
              "max |y - ref| / max |ref| against dequantize (fp32) + F.linear (fp32). At M = 1 the smaller "
              "layers' rooflines (a few us) are near a launch's own latency: their % of copy BW is bounded by it.",
              ""]
    tg = [r for r in rows if r.get("target")]
    miss = [r for r in tg if not r["target_pass"]]
    wrong = [r for r in rows if not r.get("correct", True)]
    lines += [f"Targets: {len(tg) - len(miss)} pass, {len(miss)} miss"
              + (" (" + "; ".join(f"{r['format']} {r['layer']} M={r['M']}" for r in miss) + ")" if miss else "")
              + f". Wrong results: {len(wrong)}.", ""]
    lin = [r for r in rows if r["kind"] == "linear"]
    if lin:
        lines += ["| format | model | layer | N x K | M | bits/w | weight MB | kernel us | cuBLAS us | x cuBLAS | "
                  "roofline us | GB/s | % copy BW | TFLOP/s | rel err | rel err cuBLAS | target |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in lin:
            lines.append("| " + " | ".join(map(str, [
                r["format"], r["model"], r["layer"], f"{r['N']}x{r['K']}", r["M"], r["bits_per_weight"],
                f"{r['weight_bytes'] / 1e6:.2f}", _f(r["kernel_us"]), _f(r["dense_us"]), _f(r["x_dense"], "{:.2f}x"),
                _f(r["roofline_us"]), _f(r["GBps"], "{:.0f}"), _f(100 * r["pct_copy_bw"]), _f(r["TFLOPs"]),
                _err(r), f"{r['dense_max_rel_err']:.1e}", _target(r)])) + " |")
    mo = [r for r in rows if r["kind"] == "moe"]
    if mo:
        lines += ["", f"MoE ({mo[0]['model']}, {mo[0]['layer']}, H={mo[0]['K']}): kernels = the two grouped "
                  "launches, routing precomputed; call = the whole moe_forward (routing included, with its "
                  "host sync); weight MB = the active experts' w13 + w2.", "",
                  "| M tokens | local pairs | active experts | max rows/expert | weight MB | kernels us | call us | "
                  "bf16 cuBLAS loop us | bf16 grouped Triton us | x cuBLAS | roofline us | GB/s | % copy BW | "
                  "TFLOP/s | rel err | target |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in mo:
            lines.append("| " + " | ".join(map(str, [
                r["M"], r["local_pairs"], r["active_experts"], r["max_rows_per_expert"],
                f"{r['weight_bytes'] / 1e6:.2f}", _f(r["kernel_us"]), _f(r["call_us"]), _f(r["dense_us"]),
                _f(r["bf16_grouped_triton_us"]), _f(r["x_dense"], "{:.2f}x"), _f(r["roofline_us"]),
                _f(r["GBps"], "{:.0f}"), _f(100 * r["pct_copy_bw"]), _f(r["TFLOPs"]), _err(r), _target(r)])) + " |")
        lines += ["", f"bf16 cuBLAS loop: {mo[0].get('dense_kind')}."]
    if res["errors"] or res["skipped"]:
        lines += [""]
        lines += [f"- error: {e}" for e in res["errors"]]
        lines += [f"- skipped (budget): {s}" for s in res["skipped"]]
    if res["interpreter"]:
        lines += ["", INTERP_BANNER]
    return "\n".join(lines) + "\n"


def write(res, stem):
    import json
    from pathlib import Path
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
    stem.with_suffix(".md").write_text(markdown(res))


# ---------------------------------------------------------------- main
def main(a) -> int:
    dev = a.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("quant_gpu.py: no CUDA device; use --device cpu --tiny to check the script", file=sys.stderr)
        return 2
    interp = dev == "cpu"
    ms = [int(s) for s in (a.ms or ("1,16,32" if a.tiny else "1,16,2048")).split(",")]
    iters = a.iters or (2 if a.tiny else 30)
    budget = a.budget_s if a.budget_s is not None else (150 if a.tiny else 240)
    stem = a.out or (os.path.join(tempfile.gettempdir(), "quant_gpu_tiny") if a.tiny else str(OUT / "quant_gpu"))
    dtype = torch.float16 if interp else torch.bfloat16
    t_start = time.monotonic()
    res = {"machine": machine(dev), "interpreter": interp, "tiny": a.tiny,
           "command": "python " + shlex.join(["tests/bench/quant_gpu.py", *sys.argv[1:]]),
           "dtype": str(dtype).replace("torch.", ""), "iters": iters, "ms": ms,
           "targets": {"gemv_4bit_M1_min_copy_bw": GEMV_TARGET, "gemm_max_x_cublas": GEMM_TARGET},
           "results": [], "errors": [], "skipped": []}
    if interp:
        res["WARNING"] = INTERP_BANNER.strip("*")
        log("interpreter run (TRITON_INTERPRET=1, CPU): checks the script only, the numbers mean nothing")
    bw = copy_bandwidth(dev, (2 << 30) if dev == "cuda" else (64 << 20))
    res["copy_bandwidth"] = bw
    log(f"copy bandwidth {bw['gb_s']:.0f} GB/s (best {bw['gb_s_best']:.0f}) on {res['machine'].get('gpu', 'cpu')}")
    ctx = {"device": dev, "dtype": dtype, "ms": ms, "timer": Timer(dev, iters, 1 if a.tiny else 3),
           "copy_gb_s": bw["gb_s"], "tol": 2e-2, "dense_cache": {}}
    llama = LLAMA_TINY if a.tiny else LLAMA
    ds = dsv4_shapes(a.tiny)
    groups = []                          # (label, factory -> iterator of (M, case))
    for fmt in a.formats.upper().split(","):
        if fmt == "MOE":
            groups.append((f"MOE {ds['moe']['E_local']} experts", lambda: moe_group(ctx, ds["moe"])))
        elif fmt == "MOE-GGUF":
            qm = qwen3_moe_shapes(a.tiny)
            groups.append((f"MOE-GGUF {qm['E_local']} experts", lambda: moe_group(ctx, qm, "gguf", "Qwen3-30B-A3B")))
        elif fmt in ("FP8", "MXFP4"):
            for layer, N, K in ds["fp8" if fmt == "FP8" else "fp4"]:
                groups.append((f"{fmt} {layer} {N}x{K}", lambda fmt=fmt, layer=layer, N=N, K=K:
                               linear_group(ctx, fmt, "DeepSeek-V4-Flash TP=2", layer, N, K)))
        elif fmt in F16_FIELDS:
            for layer, N, K in llama:
                groups.append((f"{fmt} {layer} {N}x{K}", lambda fmt=fmt, layer=layer, N=N, K=K:
                               linear_group(ctx, fmt, "Llama-3-8B", layer, N, K)))
        else:
            raise SystemExit(f"--formats: unknown {fmt!r}")
    total, done = len(groups) * len(ms), 0
    for label, factory in groups:
        if time.monotonic() - t_start > budget:
            res["skipped"] += [f"{label} M={M}" for M in ms]
            done += len(ms)
            continue
        try:
            cases = list(factory())            # builds the weights
        except Exception as e:
            traceback.print_exc()
            res["errors"].append(f"{label}: {type(e).__name__}: {e}")
            done += len(ms)
            continue
        for M, case in cases:
            done += 1
            if time.monotonic() - t_start > budget:
                res["skipped"].append(f"{label} M={M}")
                continue
            t0 = time.monotonic()
            try:
                r = case()
            except Exception as e:
                traceback.print_exc()
                res["errors"].append(f"{label} M={M}: {type(e).__name__}: {e}")
                log(f"[{done}/{total}] {label} M={M}: ERROR {type(e).__name__}: {e}")
                continue
            finally:
                if dev == "cuda":
                    torch.cuda.empty_cache()
            res["results"].append(r)
            log(f"[{done}/{total}] {label} M={M}: {r['kernel_us']:.1f} us, cuBLAS {_f(r['dense_us'])} us "
                f"({_f(r['x_dense'], '{:.2f}x')}), {r['GBps']:.0f} GB/s = {100 * r['pct_copy_bw']:.1f}% copy BW, "
                f"err {r['max_rel_err']:.1e}{'' if r['correct'] else ' WRONG'}, {_target(r)} "
                f"({time.monotonic() - t0:.1f} s)")
        del cases
        res["seconds"] = round(time.monotonic() - t_start, 1)
        write(res, stem)
    res["seconds"] = round(time.monotonic() - t_start, 1)
    write(res, stem)
    tg = [r for r in res["results"] if r.get("target")]
    log(f"targets: {sum(r['target_pass'] for r in tg)} pass, {sum(not r['target_pass'] for r in tg)} miss; "
        f"wrong: {sum(not r['correct'] for r in res['results'])}; errors: {len(res['errors'])}; "
        f"skipped: {len(res['skipped'])}; {res['seconds']} s")
    log(f"wrote {stem}.json / .md" + (" (INTERPRETER RUN, not a GPU measurement)" if interp else ""))
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
