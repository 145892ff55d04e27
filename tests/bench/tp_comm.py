"""Tensor-parallel communication, 2 ranks: what gloo's all-reduce and
all-gather cost here, and what DeepSeek-V4-Flash at TP=2 needs per token.

    .venv/bin/python tests/bench/tp_comm.py [--budget 3] [--quick] [--no-netns] \
        [--model deepseek-v4-flash] [--latency-us 20] [--link-gbps 200]

1. Measured (torch.distributed, gloo, CPU tensors, 2 processes, 1 torch
   thread each): all-reduce (sum) of decode-sized (8 / 16 KiB: one 4096-wide
   bf16 or fp32 row ...) and prefill-sized (16 MiB) messages in bf16 and
   fp32, and the all-gather of the LM head's vocab/2 logit halves, (a) over
   loopback (both ranks on 127.0.0.1, GLOO_SOCKET_IFNAME=lo), (b) between two
   network namespaces joined by a veth pair (tests/netns.py: one rank per
   namespace, rendezvous tcp://A.addr over the link, GLOO_SOCKET_IFNAME =
   each side's veth; needs root, else skipped with the reason). Per message:
   warm-up, then a bounded number of timed calls (at most --max-iters and
   about --budget seconds); each call timed on both ranks, the slower rank's
   time kept; median and p90 in microseconds; algorithm bandwidth bytes/time
   and bus bandwidth (nccl-tests' definitions: all-reduce 2(n-1)/n x algbw,
   all-gather (n-1)/n x algbw with bytes = the gathered output).
2. The collectives one decode step of the model really issues at TP=2:
   counted by wrapping torch.distributed's collectives around a forward of a
   tiny DeepSeek-V4 (same code, small dimensions, every layer kind) built
   under the same 2-rank gloo group, per module (embedding, each decoder
   layer, LM head, MTP head).
3. On paper, from the model config (server/plan.py's built-ins or a
   config.json): per-token collectives and bytes in bf16 at TP=2, and the
   decode ceiling that communication alone allows over a --link-gbps link
   with --latency-us per collective (default 20 us: nccl-tests
   all_reduce_perf, 2 nodes x 1 A100, HDR 200 Gb/s InfiniBand, 8 B-1 KiB:
   19-20 us, https://github.com/NVIDIA/nccl-tests/issues/150), and with the
   latencies measured in (1): tokens/s at batch 1 and batch 64.

Writes tests/bench/results/tp_comm.md.
"""
import argparse
import json
import math
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from bench_paths import OUT, ROOT, log  # puts the repo on sys.path

sys.path.insert(0, str(ROOT / "tests"))

WORLD = 2
KiB, MiB = 1024, 1024 * 1024
CITED_LATENCY_US = 20.0
CITED_SOURCE = ("nccl-tests `all_reduce_perf`, 2 nodes x 1 A100 (one GPU per node), HDR 200 Gb/s InfiniBand: "
                "19-20 us for 8 B-1 KiB all-reduces (https://github.com/NVIDIA/nccl-tests/issues/150)")


# -------------------------------------------------------------------- cases

def cases(hidden: int, vocab: int) -> list[dict]:
    """(op, dtype, elements per rank, what): sizes of the model's own collectives and round ones."""
    half = -(-vocab // WORLD)
    ar, ag = "all_reduce", "all_gather"
    return [
        dict(op=ar, dtype="bfloat16", numel=hidden, what=f"one token's hidden state ({hidden} bf16): decode, batch 1"),
        dict(op=ar, dtype="bfloat16", numel=8 * KiB, what="16 KiB bf16: decode-sized"),
        dict(op=ar, dtype="float32", numel=4 * KiB, what="16 KiB fp32: decode-sized"),
        dict(op=ar, dtype="bfloat16", numel=64 * hidden, what=f"64 tokens x {hidden} bf16: decode, batch 64"),
        dict(op=ar, dtype="bfloat16", numel=8 * MiB,
             what=f"16 MiB bf16: prefill-sized ({8 * MiB // hidden} tokens x {hidden})"),
        dict(op=ar, dtype="float32", numel=4 * MiB, what="16 MiB fp32: prefill-sized"),
        dict(op=ag, dtype="bfloat16", numel=half,
             what=f"LM-head logits, {half} bf16 per rank (vocab {vocab} / 2): batch 1"),
        dict(op=ag, dtype="bfloat16", numel=64 * half, what="LM-head logits, batch 64"),
        dict(op="broadcast_object_list", dtype="pickle", numel=4 * KiB,
             what="a 4 KiB bytes object from rank 0 (parallel.state.broadcast_object: the leader's step plan)"),
    ]


# -------------------------------------------------------------------- worker (one rank)

def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def measure(case: dict, budget: float, max_iters: int) -> dict:
    import torch
    import torch.distributed as dist
    dtype = getattr(torch, case["dtype"], torch.uint8)
    x = torch.zeros(case["numel"], dtype=dtype)          # zeros: sums never overflow nor go subnormal
    if case["op"] == "broadcast_object_list":
        obj = bytes(case["numel"]) if dist.get_rank() == 0 else None

        def call():
            dist.broadcast_object_list([obj], src=0)
        nbytes, bus = case["numel"], None
    elif case["op"] == "all_reduce":
        def call():
            dist.all_reduce(x)
        nbytes = x.numel() * x.element_size()
        bus = 2 * (WORLD - 1) / WORLD
    else:
        parts = [torch.empty_like(x) for _ in range(WORLD)]

        def call():
            dist.all_gather(parts, x)
        nbytes = WORLD * x.numel() * x.element_size()    # the gathered output
        bus = (WORLD - 1) / WORLD
    dist.barrier()
    warm = 10 if nbytes < MiB else 3
    t0 = time.perf_counter()
    for _ in range(warm):
        call()
    per = (time.perf_counter() - t0) / warm
    n = torch.tensor([min(max_iters, max(5, int(budget / max(per, 1e-7))))], dtype=torch.int64)
    dist.broadcast(n, 0)                                   # both ranks run the same count
    n = int(n)
    times = torch.empty(n, dtype=torch.float64)
    dist.barrier()
    for i in range(n):
        t = time.perf_counter()
        call()
        times[i] = time.perf_counter() - t
    both = [torch.empty_like(times) for _ in range(WORLD)]
    dist.all_gather(both, times)
    slow = torch.stack(both).max(0).values.tolist()        # the slower rank's time, per call
    med, p90 = statistics.median(slow), _percentile(slow, 0.9)
    return dict(case, bytes=nbytes, iters=n, warmup=warm, median_us=med * 1e6, p90_us=p90 * 1e6, min_us=min(slow) * 1e6,
                algbw_gbs=nbytes / med / 1e9, busbw_gbs=None if bus is None else nbytes / med / 1e9 * bus)


def tcp_rtt(rank: int, host: str, n: int = 1000, warm: int = 50) -> dict:
    """Round trips of 1 byte over a plain TCP socket (TCP_NODELAY) between the
    two ranks, rank 0 listening on `host`: the kernel's share of a collective."""
    import torch
    import torch.distributed as dist
    port = torch.zeros(1, dtype=torch.int64)
    srv = None
    if rank == 0:
        srv = socket.socket()
        srv.bind((host, 0))
        srv.listen(1)
        port[0] = srv.getsockname()[1]
    dist.broadcast(port, 0)
    times = torch.zeros(n, dtype=torch.float64)
    if rank == 0:
        c, _ = srv.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(warm + n):
            c.sendall(c.recv(1))
        srv.close()
    else:
        c = socket.create_connection((host, int(port)), timeout=30)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(warm + n):
            t = time.perf_counter()
            c.sendall(b"x")
            c.recv(1)
            if i >= warm:
                times[i - warm] = time.perf_counter() - t
    c.close()
    dist.broadcast(times, 1)
    xs = times.tolist()
    return dict(op="tcp ping-pong", dtype="-", numel=1, bytes=1, iters=n, warmup=warm,
                what="1 B each way over a plain TCP socket (TCP_NODELAY), round trip: the kernel's share",
                median_us=statistics.median(xs) * 1e6, p90_us=_percentile(xs, 0.9) * 1e6, min_us=min(xs) * 1e6)


def tiny_config(cfg: dict) -> dict:
    """The model's config shrunk (every layer kind kept: sliding, CSA, HCA; hash and score MoE; MTP)."""
    tiny = dict(cfg)
    tiny.update(vocab_size=256, hidden_size=64, num_hidden_layers=5, num_attention_heads=8, head_dim=32,
                qk_rope_head_dim=8, q_lora_rank=16, o_groups=2, o_lora_rank=8, n_routed_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=2, sliding_window=8,
                index_n_heads=4, index_head_dim=16, index_topk=4, max_position_embeddings=256,
                compress_ratios=[0, 4, 128, 4, 128, 0], num_nextn_predict_layers=1)
    for k in ("layer_types", "mlp_layer_types", "rope_scaling", "rope_parameters"):
        tiny.pop(k, None)
    return tiny


def count_collectives(cfg: dict) -> dict:
    """Wrap torch.distributed's collectives and run, at TP=2, a tiny model of
    cfg's architecture: one decode step (batch 1 and batch 4, after a
    prefill) and one MTP draft. Returns the calls per module."""
    import torch
    import torch.distributed as dist

    from kvcache.dsv4_state import DSV4Batch
    from model_zoo.deepseek_v4 import CSA, HCA, SWA
    from model_zoo.models import create_model
    from parallel import state
    state.init_tp()
    tiny = tiny_config(cfg)
    model = create_model(tiny, torch.bfloat16, "cpu")
    where = ["(outside)"]
    calls = []
    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
             "broadcast", "all_to_all", "all_to_all_single", "send", "recv", "reduce", "gather", "scatter")
    saved = {}
    for nm in names:
        fn = getattr(dist, nm, None)
        if fn is None:
            continue
        saved[nm] = fn

        def wrapped(*a, _fn=fn, _nm=nm, **kw):
            t = a[1] if _nm == "all_gather" else a[0]
            calls.append(dict(where=where[-1], op=_nm, shape=list(t.shape), dtype=str(t.dtype).replace("torch.", ""),
                              bytes=t.numel() * t.element_size()))
            return _fn(*a, **kw)
        setattr(dist, nm, wrapped)

    def tag(module, label):
        def pre(m, a, _l=label):
            where.append(_l)

        def post(m, a, o):
            where.pop()
        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
    m = model.model
    tag(m.embed_tokens, "embedding")
    for i, layer in enumerate(m.layers):
        kind = {SWA: "sliding", CSA: "CSA", HCA: "HCA"}[layer.self_attn.layer_type]
        label = f"layer {i} ({kind} attention, " \
                f"{'hash' if layer.mlp.gate.is_hash else 'score'}-routed moe)"
        tag(layer, label)
        tag(layer.self_attn, f"{label} / attention")
        tag(layer.mlp, f"{label} / moe")
    tag(model.lm_head, "lm_head")
    if model.has_mtp:   # draft_streams calls the block's forward directly: tag its parts
        tag(model.mtp[0].self_attn, "mtp / attention")
        tag(model.mtp[0].mlp, "mtp / moe")
    out = {}
    try:
        with torch.no_grad():
            ids = torch.arange(1, 9)
            for batch in (1, 4):
                states = [model.new_state() for _ in range(batch)]
                for st in states:                              # prefill 7 tokens each, not counted
                    model(ids[:7], torch.arange(7), DSV4Batch([st], [0, 7]))
                calls.clear()
                dec = ids[7:8].repeat(batch)
                hidden = model(dec, torch.full((batch,), 7), DSV4Batch(states, list(range(batch + 1))))
                model.compute_logits(hidden)
                out[f"decode_batch{batch}"] = list(calls)
            if model.has_mtp:
                streams = model.forward_streams(ids[:1], torch.arange(1), None)
                calls.clear()
                model.compute_logits(model.mtp_forward(ids[1:2], streams, torch.arange(1), None))
                out["mtp_draft_batch1"] = list(calls)
    finally:
        for nm, fn in saved.items():
            setattr(dist, nm, fn)
        state.reset_tp()
    out["tiny_config"] = {k: tiny[k] for k in ("hidden_size", "vocab_size", "num_hidden_layers", "compress_ratios",
                                               "num_hash_layers", "hc_mult")}
    return out


def worker(args) -> int:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    try:
        # correctness first: rank r contributes r + 1 -> every element is 3
        t = torch.full((1000,), float(args.rank + 1))
        dist.all_reduce(t)
        assert bool((t == 3).all()), "all_reduce gave a wrong sum"
        res = {"cases": [], "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}
        res["tcp"] = tcp_rtt(args.rank, args.init.split("//")[1].rsplit(":", 1)[0])
        for case in json.loads(args.cases):
            r = measure(case, args.budget, args.max_iters)
            res["cases"].append(r)
            if args.rank == 0:
                log(f"  {r['op']} {r['bytes']} B {r['dtype']}: median {r['median_us']:.1f} us, "
                    f"p90 {r['p90_us']:.1f} us ({r['iters']} iters)")
        if args.count_collectives:
            from server.plan import load_config
            res["collectives"] = count_collectives(load_config(args.model)[1])
        if args.rank == 0:
            print("RESULT " + json.dumps(res), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


# -------------------------------------------------------------------- launcher

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_argv(args, rank: int, init: str, cs: list, count: bool) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--rank", str(rank), "--init", init,
            "--budget", str(args.budget), "--max-iters", str(args.max_iters), "--cases", json.dumps(cs),
            "--model", args.model]
    return argv + (["--count-collectives"] if count else [])


def _collect(procs: list, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for rc, out in outs:
        if rc:
            raise RuntimeError(f"a rank exited with {rc}")
    line = next(ln for ln in outs[0][1].splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def run_loopback(args, cs: list) -> dict:
    init = f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen(_worker_argv(args, r, init, cs, count=True), env=env,
                              stdout=subprocess.PIPE, text=True) for r in range(WORLD)]
    res = _collect(procs, args.timeout)
    res["init"] = init
    res["link"] = "loopback (lo, MTU " + _mtu(["ip", "-o", "link", "show", "lo"]) + ")"
    return res


def run_netns(args, cs: list) -> dict:
    from netns import two_nodes
    with two_nodes() as (a, b):
        init = f"tcp://{a.addr}:29500"
        procs = [node.popen(_worker_argv(args, r, init, cs, count=False),
                            env={**os.environ, "GLOO_SOCKET_IFNAME": node.ifname},
                            stdout=subprocess.PIPE, text=True) for r, node in enumerate((a, b))]
        res = _collect(procs, args.timeout)
        res["init"] = init
        res["gloo_ifname"] = f"{a.ifname} (rank 0) / {b.ifname} (rank 1)"
        mtu = _mtu(a.argv(["ip", "-o", "link", "show", a.ifname]))
        res["link"] = (f"veth pair between network namespaces {a.name} ({a.addr}, {a.ifname}) and "
                       f"{b.name} ({b.addr}, {b.ifname}), MTU {mtu}")
    return res


def _mtu(argv) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout.split()
        return out[out.index("mtu") + 1]
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return "?"


def cpu_busy(seconds: float = 1.0) -> float | None:
    """Share of all CPUs busy over `seconds` (/proc/stat), before anything of ours runs."""
    def read():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0)     # total, idle + iowait
    try:
        t0, i0 = read()
        time.sleep(seconds)
        t1, i1 = read()
    except (OSError, ValueError, IndexError):
        return None
    return 1 - (i1 - i0) / max(1, t1 - t0)


def busy_processes() -> list[str]:
    """Other processes using a CPU right now (ps' lifetime %CPU above 20)."""
    try:
        out = subprocess.run(["ps", "-eo", "pid=,pcpu=,etime=,args="], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    busy = []
    for ln in out.splitlines():
        f = ln.split(None, 3)
        if len(f) == 4 and float(f[1]) >= 20 and int(f[0]) != os.getpid():
            busy.append(f"pid {f[0]} {f[1]}% CPU ({f[2]}): {f[3][:80]}")
    return busy


# -------------------------------------------------------------------- the model on paper

def comm_model(collectives: dict, cfg: dict, tp: int) -> dict:
    """Per-token collectives of the full model, from the tiny model's counted
    calls scaled to cfg: per-module call counts, and element counts mapped
    from the tiny widths (hidden, vocab/tp) to the real ones."""
    from model_zoo.deepseek_v4 import normalise_config
    c = normalise_config(cfg)
    tiny = collectives["tiny_config"]
    H, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    half, tiny_half = -(-V // tp), -(-tiny["vocab_size"] // tp)

    def real_elems(call, batch):
        n = math.prod(call["shape"]) // batch
        if n == tiny["hidden_size"]:
            return H, "hidden"
        if n == tiny_half:
            return half, "vocab/tp"
        raise ValueError(f"collective of {call['shape']} is neither hidden nor vocab/tp wide: {call}")

    def per_module(calls, batch):
        rows = {}
        for call in calls:
            w = call["where"]
            layer, _, sub = w.partition(" / ")
            key = f"decoder layer / {sub}" if w.startswith("layer ") else w
            n, kind = real_elems(call, batch)
            r = rows.setdefault((key, call["op"], kind), dict(module=key, op=call["op"], kind=kind, elems=n,
                                                              calls=0, layers=set()))
            r["calls"] += 1
            if w.startswith("layer "):
                r["layers"].add(layer)
        return rows

    rows = per_module(collectives["decode_batch1"], 1)
    # every decoder layer of the tiny model issues the same calls; the real one has L of them
    layer_calls = {}
    for call in collectives["decode_batch1"]:
        if call["where"].startswith("layer "):
            layer, _, sub = call["where"].partition(" / ")
            layer_calls.setdefault(layer, []).append(f"{call['op']} ({sub})")
    per_layer = {tuple(v) for v in layer_calls.values()}
    if len(per_layer) != 1 or len(layer_calls) != tiny["num_hidden_layers"]:
        raise ValueError(f"decoder layers issue different collectives: {layer_calls}")
    table = []
    for r in rows.values():
        count = r["calls"] // len(r["layers"]) * L if r["layers"] else r["calls"]
        table.append(dict(module=r["module"], op=r["op"], elems=r["elems"], kind=r["kind"],
                          per_layer=r["calls"] // len(r["layers"]) if r["layers"] else None, count=count))
    b4 = collectives["decode_batch4"]
    same_count = len(b4) == len(collectives["decode_batch1"]) and all(
        math.prod(x["shape"]) == 4 * math.prod(y["shape"]) for x, y in zip(b4, collectives["decode_batch1"]))
    mtp = [dict(module=r["module"], op=r["op"], elems=r["elems"], kind=r["kind"], count=r["calls"])
           for r in per_module(collectives.get("mtp_draft_batch1", []), 1).values()]
    return dict(H=H, V=V, L=L, tp=tp, half=half, hc_mult=c["hc_mult"], table=table, mtp=mtp,
                per_layer_ops=list(next(iter(per_layer))), batch_scales=same_count)


def wire_bytes(op: str, elems: int, tp: int, el: int = 2) -> float:
    """Bytes one rank sends per call (ring): all-reduce of S bytes 2(t-1)/t S;
    all-gather of a per-rank part P: (t-1) P."""
    s = elems * el
    return 2 * (tp - 1) / tp * s if op == "all_reduce" else (tp - 1) * s


def ceiling(rows: list[dict], tp: int, batch: int, lat_us: dict, bw: float) -> tuple[float, float, float]:
    """(seconds per decode step for communication, of which latency, tokens/s) at batch size `batch`."""
    lat = sum(r["count"] * lat_us[r["op"]] * 1e-6 for r in rows)
    data = sum(r["count"] * wire_bytes(r["op"], r["elems"] * batch, tp) / bw for r in rows)
    t = lat + data
    return t, lat, batch / t


# -------------------------------------------------------------------- report

def fmt_bytes(n: float) -> str:
    if n >= MiB:
        return f"{n / MiB:.2f} MiB" if n % MiB else f"{n // MiB} MiB"
    if n >= KiB:
        return f"{n / KiB:.1f} KiB" if n % KiB else f"{n // KiB} KiB"
    return f"{n:.0f} B"


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.0f}%"


def results_table(res: dict) -> list[str]:
    lines = ["| collective | dtype | bytes | message | iters | median us | p90 us | min us | algbw GB/s | busbw GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["cases"] + [res["tcp"]]:
        if r["op"] == "tcp ping-pong":
            lines.append(f"| {r['op']} | - | 1 | {r['what']} | {r['iters']} | {r['median_us']:.1f} | "
                         f"{r['p90_us']:.1f} | {r['min_us']:.1f} | - | - |")
            continue
        bus = "-" if r["busbw_gbs"] is None else f"{r['busbw_gbs']:.3f}"
        lines.append(f"| {r['op']} | {r['dtype']} | {r['bytes']:,} ({fmt_bytes(r['bytes'])}) | {r['what']} | "
                     f"{r['iters']} | {r['median_us']:.1f} | {r['p90_us']:.1f} | {r['min_us']:.1f} | "
                     f"{r['algbw_gbs']:.3f} | {bus} |")
    return lines


def report(args, machine, started, loads, cpus, busy0, busy1, measured: dict, skipped: dict,
           model: dict, collectives: dict) -> str:
    import torch
    from server.bench import machine_line
    tp = model["tp"]
    L, H, V, half = model["L"], model["H"], model["V"], model["half"]
    rows = model["table"]
    cmd = ".venv/bin/python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0]))] + sys.argv[1:])
    out = [f"# Tensor-parallel communication, 2 ranks ({started})", "",
           f"Command: `{cmd}` (as root: the namespace part needs it)", "",
           f"Machine: {machine_line(machine)}; torch {torch.__version__}, gloo backend, CPU tensors, "
           f"1 torch thread per rank, both ranks on this one machine.",
           f"Other work on the machine: load average (1 min) {loads[0]:.2f} at start, {loads[1]:.2f} at end; "
           f"CPUs busy over the second before the start {_pct(cpus[0])}, over the second after the end "
           f"{_pct(cpus[1])}. "
           + ("Busy processes at start (ps, lifetime %CPU >= 20): " + "; ".join(busy0) + ". " if busy0 else
              "No busy process at start (ps: none at or above 20% CPU). ")
           + ("At end: " + "; ".join(busy1) + "." if busy1 else "None at end."), "",
           "## 1. Measured: gloo all-reduce and all-gather", "",
           f"Each message: warm-up (10 calls, 3 at >= 1 MiB), then N timed calls, N = min({args.max_iters}, "
           f"~{args.budget:g} s / warm-up time per call) (at least 5), the same N on both ranks. Each call is "
           "timed on both ranks and the slower rank's time kept; min = the fastest call (a shared machine's noise "
           "only slows calls down). bytes = the all-reduced buffer / the "
           "all-gathered output (both ranks' parts); algbw = bytes / median time; busbw = algbw x 2(n-1)/n for "
           "all-reduce, x (n-1)/n for all-gather (nccl-tests' definitions; n = 2: all-reduce busbw = algbw, "
           "all-gather busbw = algbw / 2). No wire anywhere: these are the costs of gloo and the kernel's "
           "TCP stack on this CPU (and of crossing namespaces over veth), not of a 200 Gb/s link.", ""]
    for key, title in (("loopback", "(a) Loopback: two processes on 127.0.0.1"),
                       ("netns", "(b) Two network namespaces joined by a veth pair (one rank in each)")):
        out.append(f"### {title}")
        out.append("")
        if key in measured:
            out.append(f"Link: {measured[key]['link']}; GLOO_SOCKET_IFNAME={measured[key]['gloo_ifname']}"
                       + (f"; rendezvous {measured[key]['init']}" if measured[key].get("init") else "") + ".")
            out.append("")
            out += results_table(measured[key])
            ar = min((c for c in measured[key]["cases"] if c["op"] == "all_reduce"), key=lambda c: c["bytes"])
            rtt = measured[key]["tcp"]["median_us"]
            out += ["", f"The smallest all-reduce ({fmt_bytes(ar['bytes'])}) takes {ar['median_us'] / rtt:.0f}x a "
                    f"plain TCP round trip between the same two processes ({ar['median_us']:.0f} vs {rtt:.0f} us): "
                    "at decode sizes the cost is per-call software overhead (gloo, its threads, scheduling on this "
                    "shared 2-CPU machine), not bytes on the link."]
        else:
            out.append(f"Not run: {skipped.get(key, 'skipped')}.")
        out.append("")

    # ---- 2
    dec1 = collectives["decode_batch1"]
    out += ["## 2. The collectives one decode step issues (counted, TP=2)", "",
            "torch.distributed's collectives wrapped (all_reduce, all_gather, broadcast, reduce_scatter, "
            "all_to_all, send/recv, ...) around a bf16 forward of a tiny DeepSeek-V4 built from "
            f"`model_zoo/deepseek_v4.py` under the 2-rank gloo group of run (a): config "
            f"{json.dumps(collectives['tiny_config'])} (layer kinds sliding / CSA / HCA, hash- and "
            "score-routed MoE, 4 hyper-connection streams, MTP head), one decode step after a 7-token prefill, "
            "then `compute_logits`. Calls per module (batch 1):", "",
            "| module | collective | per-rank shape | dtype | calls |", "|---|---|---|---|---|"]
    agg = {}
    for cl in dec1:
        k = (cl["where"], cl["op"], tuple(cl["shape"]), cl["dtype"])
        agg[k] = agg.get(k, 0) + 1
    for (w, op, shape, dt), n in agg.items():
        out.append(f"| {w} | {op} | {list(shape)} | {dt} | {n} |")
    if collectives.get("mtp_draft_batch1"):
        agg = {}
        for cl in collectives["mtp_draft_batch1"]:
            k = (cl["where"], cl["op"], tuple(cl["shape"]), cl["dtype"])
            agg[k] = agg.get(k, 0) + 1
        out.append("| **one MTP draft** (`mtp_forward` + `compute_logits`) | | | | |")
        for (w, op, shape, dt), n in agg.items():
            out.append(f"| {w} | {op} | {list(shape)} | {dt} | {n} |")
    out += ["", f"Batch 4 issues the same calls with 4x the rows: {'yes' if model['batch_scales'] else 'NO'} "
            "(the number of collectives per step does not grow with the batch; their size does). Every decoder "
            f"layer issues the same two all-reduces ({', '.join(model['per_layer_ops'])}): attention's "
            "`o_b_proj` (RowParallelLinear) and the MoE's single all-reduce of routed experts + shared expert "
            "(the shared expert's down projection is not reduced on its own). Both act on the collapsed "
            f"[tokens, hidden] activations, not on the {model['hc_mult']} hyper-connection streams: the streams "
            "are collapsed before attention / MoE and recombined after, replicated on every rank, so hc_mult "
            "does not multiply the all-reduced size. The embedding is vocabulary-split (one all-reduce of "
            "[tokens, hidden]); the LM head all-gathers each rank's vocab/2 logits in the model dtype (bf16) "
            "and `compute_logits` casts to fp32 after. Nothing else communicates: q_a, the K=V projection, "
            "compressors, indexer, router, norms and hyper-connections are replicated. Outside the model, the "
            "tensor-parallel engine (engine/follower.py: rank 0 schedules and samples) broadcasts each step's "
            "plan from rank 0 with `broadcast_object_list` over the gloo group: one host-side broadcast per "
            "step, not in the table above (its cost is in section 1, and below).", ""]

    # ---- 3
    bw = args.link_gbps * 1e9 / 8
    per_tok_buf = sum(r["count"] * r["elems"] * 2 * (1 if r["op"] == "all_reduce" else tp) for r in rows)
    per_tok_wire = sum(r["count"] * wire_bytes(r["op"], r["elems"], tp) for r in rows)
    n_coll = sum(r["count"] for r in rows)
    out += [f"## 3. On paper: {args.model} at TP={tp}, decode, bf16", "",
            f"From the config (`server/plan.py` `{args.model}` / `normalise_config`): hidden_size {H}, "
            f"vocab_size {V} (vocab/{tp} = {half} per rank), {L} decoder layers, hc_mult {model['hc_mult']}; "
            "calls per module as counted in section 2, widths from this config. Per token "
            "(per sequence in a decode step):", "",
            "| module | collective | calls per step | elements per call per token | bytes per call per token | "
            "sent per rank per call (ring) |", "|---|---|---|---|---|---|"]
    for r in rows:
        nb = r["elems"] * 2 * (1 if r["op"] == "all_reduce" else tp)
        calls = f"{r['per_layer']} x {L} layers = {r['count']}" if r["per_layer"] else str(r["count"])
        out.append(f"| {r['module']} | {r['op']} | {calls} | {r['elems']} ({r['kind']}) | "
                   f"{nb:,} ({fmt_bytes(nb)}) | {wire_bytes(r['op'], r['elems'], tp):,.0f} |")
    out += [f"| **total** | | **{n_coll}** | | **{per_tok_buf:,} ({fmt_bytes(per_tok_buf)})** | "
            f"**{per_tok_wire:,.0f} ({fmt_bytes(per_tok_wire)})** |", ""]
    if model["mtp"]:
        mtp_n = sum(r["count"] for r in model["mtp"])
        mtp_w = sum(r["count"] * wire_bytes(r["op"], r["elems"], tp) for r in model["mtp"])
        out += [f"With MTP speculative decoding each draft adds {mtp_n} collectives "
                f"({', '.join(str(r['count']) + ' ' + r['op'] + ' (' + r['module'] + ')' for r in model['mtp'])}), "
                f"{mtp_w:,.0f} B sent per rank per drafted token, and a verification step carries k + 1 "
                "tokens per sequence through the main model's collectives (same count, k + 1 x the bytes).", ""]
    bytes_note = ("bytes per call = the all-reduced buffer, or the all-gathered output; sent per rank (ring, "
                  "t = 2) = 2(t-1)/t x buffer for an all-reduce (= the buffer) and (t-1) x its own part for the "
                  "all-gather.")
    out += [bytes_note, ""]

    lat_sets = [(f"cited NCCL latency, {CITED_LATENCY_US:g} us per collective", {"all_reduce": CITED_LATENCY_US,
                                                                                 "all_gather": CITED_LATENCY_US},
                 CITED_SOURCE)]
    if args.latency_us != CITED_LATENCY_US:
        lat_sets.insert(0, (f"--latency-us {args.latency_us:g}", {"all_reduce": args.latency_us,
                                                                   "all_gather": args.latency_us}, "assumed"))
    for key, label in (("netns", "gloo over veth, measured here"), ("loopback", "gloo over loopback, measured here")):
        if key in measured:
            cs = measured[key]["cases"]
            ar = next(c for c in cs if c["op"] == "all_reduce" and c["numel"] == H)
            ag = next(c for c in cs if c["op"] == "all_gather" and c["numel"] == half)
            lat_sets.append((f"{label}: {ar['median_us']:.0f} us per all-reduce, {ag['median_us']:.0f} us per "
                             "all-gather", {"all_reduce": ar["median_us"], "all_gather": ag["median_us"]},
                             f"section 1 ({key}) medians at batch-1 sizes, used as pure latency"))
    out += [f"Decode ceiling from communication alone over a {args.link_gbps:g} Gb/s link "
            f"({bw / 1e9:g} GB/s per direction, full line rate assumed), collectives serialised (each layer "
            "waits for its all-reduces): step time = sum over calls of (latency + bytes sent per rank / "
            "bandwidth), tokens/s = batch / step time. Compute, memory traffic and the host are ignored: "
            "these are upper bounds.", "",
            "| latency per collective | batch | calls per step | latency part ms | data part ms | step ms | "
            "tokens/s ceiling |", "|---|---|---|---|---|---|---|"]
    for label, lat, _src in lat_sets:
        for batch in (1, 64):
            t, tl, tps = ceiling(rows, tp, batch, lat, bw)
            out.append(f"| {label} | {batch} | {n_coll} | {tl * 1e3:.3f} | {(t - tl) * 1e3:.3f} | {t * 1e3:.3f} | "
                       f"{tps:,.0f} |")
    out += ["", "Latency sources:", ""] + [f"- {label}: {src}" for label, _lat, src in lat_sets] + [""]
    lat0 = lat_sets[0][1]
    t1, l1, tps1 = ceiling(rows, tp, 1, lat0, bw)
    t64, l64, tps64 = ceiling(rows, tp, 64, lat0, bw)
    h64, _, htps64 = ceiling(rows, tp, 64, lat0, bw / 2)
    out += [f"Reading ({lat_sets[0][0]}): at batch 1 the link's bandwidth hardly matters "
            f"({(t1 - l1) * 1e6:.0f} us of data per token vs {l1 * 1e6:.0f} us of latency for {n_coll} serial "
            f"collectives): the ceiling is {tps1:,.0f} tokens/s, set by per-collective latency, so fewer or "
            "fused collectives (or overlapping them with compute) matter more than bandwidth. At batch 64 the "
            f"data part is {(t64 - l64) * 1e3:.2f} ms against {l64 * 1e3:.2f} ms of latency "
            f"({tps64:,.0f} tokens/s); at half the bandwidth ({bw / 2e9:g} GB/s, e.g. NCCL on one of the two "
            f"~100 Gb/s PCIe x4 halves a DGX Spark's 200 Gb/s port is split into) it would be "
            f"{h64 * 1e3:.2f} ms per step ({htps64:,.0f} tokens/s).", ""]
    for key in ("netns", "loopback"):
        if key in measured:
            bc = next(c for c in measured[key]["cases"] if c["op"] == "broadcast_object_list")
            extra = bc["median_us"] * 1e-6
            out += [f"Plus the step plan: one `broadcast_object_list` per step, {bc['median_us']:.0f} us with gloo "
                    f"here ({key}, 4 KiB). Added to the batch-1 step at the cited NCCL latency: "
                    f"{(t1 + extra) * 1e3:.3f} ms, {1 / (t1 + extra):,.0f} tokens/s (batch 64: "
                    f"{64 / (t64 + extra):,.0f}). Over the real link the plan goes through gloo's TCP transport "
                    "on the host, not NCCL: its latency is the host TCP round trip plus gloo's own overhead, "
                    "as measured in section 1, not NCCL's.", ""]
            break
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, default=3.0, help="seconds of timed calls per message (about)")
    ap.add_argument("--max-iters", type=int, default=1000, help="timed calls per message at most")
    ap.add_argument("--quick", action="store_true", help="0.3 s per message, 100 calls at most: does it run")
    ap.add_argument("--no-netns", action="store_true", help="loopback only")
    ap.add_argument("--model", default="deepseek-v4-flash", help="server/plan.py built-in name or config.json")
    ap.add_argument("--latency-us", type=float, default=CITED_LATENCY_US,
                    help="per-collective latency for the on-paper ceiling (default: the cited NCCL number)")
    ap.add_argument("--link-gbps", type=float, default=200.0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per 2-rank run")
    ap.add_argument("--out", type=Path, default=OUT / "tp_comm.md")
    # worker mode (one rank)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--init", help=argparse.SUPPRESS)
    ap.add_argument("--cases", help=argparse.SUPPRESS)
    ap.add_argument("--count-collectives", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.budget, args.max_iters = 0.3, 100

    from model_zoo.deepseek_v4 import normalise_config
    from netns import netns_unavailable
    from server.bench import machine_info
    from server.plan import load_config
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    load0, busy0, cpu0 = os.getloadavg()[0], busy_processes(), cpu_busy()
    _, cfg = load_config(args.model)
    c = normalise_config(cfg)
    cs = cases(c["hidden_size"], c["vocab_size"])
    measured, skipped = {}, {}
    log("loopback ...")
    t0 = time.monotonic()
    measured["loopback"] = run_loopback(args, cs)
    log(f"loopback done in {time.monotonic() - t0:.0f} s")
    collectives = measured["loopback"].pop("collectives")
    if args.no_netns:
        skipped["netns"] = "--no-netns"
    elif (why := netns_unavailable()):
        skipped["netns"] = why
        log(f"namespaces: skipped ({why})")
    else:
        log("two namespaces ...")
        t0 = time.monotonic()
        measured["netns"] = run_netns(args, cs)
        log(f"namespaces done in {time.monotonic() - t0:.0f} s")
    model = comm_model(collectives, cfg, WORLD)
    load1, busy1, cpu1 = os.getloadavg()[0], busy_processes(), cpu_busy()
    text = report(args, machine_info(), started, (load0, load1), (cpu0, cpu1), busy0, busy1, measured, skipped,
                  model, collectives)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
