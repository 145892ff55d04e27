"""Tensor-parallel decode on this CPU: Gemma3-270M at TP=1 vs TP=2.

    .venv/bin/python tests/bench/tp_decode.py [--output-len 128] [--batches 1,8] \
        [--configs f32:1x2,f32:1x1,f32:2x1,f32:2x2,bf16:1x2,bf16:2x1] [--wait-quiet 600] [--quick]

What it measures, in one run (a few minutes on 2 cores):

1. Decode tokens/s of `engine.LLM("gemma3-270m", tensor_parallel_size=TP,
   num_threads=T)` (the real weights: the GGUF package's Q4_K_M
   dequantized to the run's dtype, or kept as blocks with --quantization gguf)
   for each config DTYPE:TPxT (TP ranks, T
   torch threads per rank; the second rank is a process the engine starts,
   gloo collectives over loopback): TP=1 with 2 threads vs TP=2 with 1
   thread per rank (the same 2 cores), TP=2 with 2 threads per rank
   (oversubscribed), TP=1 with 1 thread (how far a second core helps one
   process), fp32 and bf16. Batch 1 and batch 8 (8 requests added at once),
   ~32-token prompts (tinyshakespeare slices, fixed seed, the same in every
   config), --output-len tokens each, greedy, ignore_eos. Decode excludes
   prefill: tokens after the step in which every request got its first token,
   over the time from the end of that step to the end of the last one.
   Step time (median of the decode steps), of which the forward, and the
   greedy tokens of every TP=2 run compared with TP=1 of the same dtype and
   batch (requests whose tokens differ, first differing position).
2. The collectives of one decode step at TP=2, counted and timed on rank 0
   by wrapping torch.distributed's all_reduce / all_gather /
   broadcast_object_list in this (the leader's) process: row-parallel o_proj
   and down_proj per layer, the vocab-parallel embedding's all-reduce, the LM
   head's all-gather, the step plan's broadcast (engine/follower.py). The
   time inside them on rank 0 includes waiting for rank 1 to get there.
3. The same collectives alone: 2 fresh processes (1 torch thread each,
   gloo, GLOO_SOCKET_IFNAME as in this environment) time an all-reduce of a
   hidden-size row (640 values) and of 8 rows, the LM head's all-gather
   (vocab/2 logits per rank, batch 1 and 8) and a step-plan-sized
   broadcast_object_list (timed as tests/bench/tp_comm.py does: the slower
   rank's time per call; median, mean, p90), and the all-reduces again, each
   after an untimed matmul of half a layer's shard (the ranks computing
   between collectives, as in a step; rank 0's mean). Counted calls x these
   times = what communication alone costs per step, against the step time.

CPU time of other processes during every timed window is recorded (from
/proc: all busy CPU time minus this process tree's), so contention shows; a
run during which they used more than --max-other-cores is rerun (at most
--retries times, the cleanest kept), and --wait-quiet S first waits up to S
seconds for the CPUs to go idle (on a shared machine). About 17 minutes on
2 idle cores (--repeats 1: about 10; each config's startup took 20-45 s
while gguf-py's reader parsed the vocabulary's metadata, less since
model_zoo/gguf_file.py).
Writes tests/bench/results/tp_decode.md.
"""
import argparse
import functools
import json
import os
import pickle
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_paths import OUT, log, make_prompts  # puts the repo on sys.path

MODEL = "gemma3-270m"
DTYPES = {"f32": "float32", "bf16": "bfloat16"}


# -------------------------------------------------------------------- contention

def _proc_stats() -> dict[int, tuple[int, float]]:
    """{pid: (ppid, cpu seconds)} of every process, its reaped children's included
    (a child that exits and is waited for moves its time into the parent's)."""
    tck = os.sysconf("SC_CLK_TCK")
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            s = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        f = s[s.rindex(")") + 2:].split()
        out[int(d)] = (int(f[1]), sum(int(x) for x in f[11:15]) / tck)
    return out


def _busy_seconds() -> float:
    """All CPUs' busy time so far (user nice system irq softirq), from /proc/stat."""
    f = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in f[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """CPU seconds other processes used between start() and stop(): all busy
    time minus this process tree's (the engine's second rank included)."""

    def start(self):
        self.t0, self.busy0 = time.perf_counter(), _busy_seconds()
        self.mine0 = self._mine()
        return self

    def _mine(self) -> dict[int, float]:
        st = _proc_stats()
        tree, frontier = {os.getpid()}, [os.getpid()]
        while frontier:
            p = frontier.pop()
            for pid, (ppid, _) in st.items():
                if ppid == p and pid not in tree:
                    tree.add(pid)
                    frontier.append(pid)
        return {p: st[p][1] for p in tree if p in st}

    def stop(self) -> dict:
        busy, mine, wall = _busy_seconds(), self._mine(), time.perf_counter() - self.t0
        own = sum(v - self.mine0.get(p, 0.0) for p, v in mine.items())
        other = max(0.0, busy - self.busy0 - own)
        return {"wall_s": wall, "own_cpu_s": own, "other_cpu_s": other, "other_cores": other / wall}


def code_state() -> str:
    """The commit the engine ran from, and uncommitted changes to its sources."""
    from bench_paths import ROOT
    git = ["git", "-C", str(ROOT)]
    try:
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--", "engine", "model_zoo", "parallel", "kvcache",
                                      "server"], capture_output=True, text=True, timeout=10).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    dirty = [ln[3:] for ln in dirty if ln.strip()]
    return f"commit {head or '?'}" + (f", uncommitted changes in {', '.join(dirty)}" if dirty else
                                       " (engine, model_zoo, parallel, kvcache, server as committed)")


def wait_quiet(max_s: float, own_cores: float = 0.05, quiet: float = 0.15, window: float = 5.0) -> float:
    """Wait (at most max_s) until other processes use under `quiet` cores for two
    windows in a row; returns the seconds waited. This tree is idle meanwhile
    (the engine's heartbeat aside), so all busy CPU is someone else's."""
    t0, calm = time.monotonic(), 0
    while time.monotonic() - t0 < max_s and calm < 2:
        a = _busy_seconds()
        time.sleep(window)
        busy = (_busy_seconds() - a) / window - own_cores
        calm = calm + 1 if busy < quiet else 0
    return time.monotonic() - t0


def kernel_line() -> str:
    """The kernel, its timer tick and preemption model (/proc/config.gz when there is one)."""
    import gzip
    import platform
    line = f"Linux {platform.release()}"
    try:
        cfg = gzip.decompress(Path("/proc/config.gz").read_bytes()).decode(errors="replace").splitlines()
    except OSError:
        return line
    hz = next((ln.split("=")[1] for ln in cfg if ln.startswith("CONFIG_HZ=")), None)
    pre = next((ln[len("CONFIG_"):-2] for ln in cfg if ln in ("CONFIG_PREEMPT_NONE=y", "CONFIG_PREEMPT_VOLUNTARY=y",
                                                             "CONFIG_PREEMPT=y", "CONFIG_PREEMPT_RT=y",
                                                             "CONFIG_PREEMPT_LAZY=y")), None)
    return line + (f", CONFIG_HZ={hz} ({1000 / int(hz):g} ms tick)" if hz else "") + (f", {pre}" if pre else "")


def busy_now() -> list[str]:
    from tp_comm import busy_processes
    return busy_processes()


# -------------------------------------------------------------------- rank 0's collectives

class CommProbe:
    """Counts and times torch.distributed's collectives in this process while `on`."""
    OPS = ("all_reduce", "all_gather", "broadcast_object_list")

    def __init__(self):
        import torch.distributed as dist
        self.on = False
        self.calls: list[tuple[str, float, int]] = []
        for nm in self.OPS:
            setattr(dist, nm, self._wrap(nm, getattr(dist, nm)))

    def _wrap(self, nm, fn):
        def wrapped(*a, **kw):
            if not self.on:
                return fn(*a, **kw)
            t = time.perf_counter()
            r = fn(*a, **kw)
            dt = time.perf_counter() - t
            if nm == "all_reduce":
                nbytes = a[0].numel() * a[0].element_size()
            elif nm == "all_gather":
                nbytes = len(a[0]) * a[1].numel() * a[1].element_size()      # the gathered output
            else:
                nbytes = len(pickle.dumps(a[0][0])) if a[0][0] is not None else 0
            self.calls.append((nm, dt, nbytes))
            return r
        return wrapped

    def take(self) -> list[tuple[str, float, int]]:
        c, self.calls = self.calls, []
        return c


# -------------------------------------------------------------------- one config

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_batch(llm, prompts, out_len, probe) -> dict:
    """All prompts at once, stepped to the end; decode tok/s without prefill."""
    from engine import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    runner = llm.core.runner
    fwd_times = []
    orig = runner.forward

    def timed_forward(plan):
        t = time.perf_counter()
        r = orig(plan)
        fwd_times.append(time.perf_counter() - t)
        return r
    runner.forward = timed_forward
    rids = [llm.add_request(p, sp) for p in prompts]
    have = {r: 0 for r in rids}
    tokens = {}
    steps = []
    load = OtherLoad().start()
    probe.on = True
    try:
        while llm.core.has_work():
            probe.take()
            n_fwd = len(fwd_times)
            t0 = time.perf_counter()
            outs = llm.step()
            t1 = time.perf_counter()
            new = 0
            for o in outs:
                n = len(o.outputs[0].token_ids)
                new += n - have[o.request_id]
                have[o.request_id] = n
                if o.finished:
                    tokens[o.request_id] = list(o.outputs[0].token_ids)
            steps.append(dict(t_end=t1, dt=t1 - t0, new=new, all_started=min(have.values()) > 0,
                              fwd=sum(fwd_times[n_fwd:]), comm=probe.take()))
    finally:
        probe.on = False
        del runner.forward
    other = load.stop()
    assert sorted(tokens) == sorted(rids) and all(len(tokens[r]) == out_len for r in rids), \
        f"expected {out_len} tokens per request, got {[len(tokens.get(r, [])) for r in rids]}"
    k = next(i for i, s in enumerate(steps) if s["all_started"])
    dec = steps[k + 1:]
    n_tok = sum(s["new"] for s in dec)
    span = steps[-1]["t_end"] - steps[k]["t_end"]
    comm = {}
    for op in CommProbe.OPS:
        per_step = [[c for c in s["comm"] if c[0] == op] for s in dec]
        counts = sorted({len(x) for x in per_step})
        comm[op] = dict(calls_per_step=counts,
                        median_ms=statistics.median(sum(c[1] for c in x) for x in per_step) * 1e3,
                        bytes_per_call=sorted({c[2] for x in per_step for c in x}))
    return dict(batch=len(prompts), decode_tok_s=n_tok / span, decode_tokens=n_tok, decode_s=span,
                decode_steps=len(dec), prefill_steps=k + 1,
                step_ms=statistics.median(s["dt"] for s in dec) * 1e3,
                fwd_ms=statistics.median(s["fwd"] for s in dec) * 1e3,
                comm_ms=statistics.median(sum(c[1] for c in s["comm"]) for s in dec) * 1e3,
                comm=comm, plan_bytes=max((c[2] for s in dec for c in s["comm"] if c[0] == "broadcast_object_list"),
                                          default=0),
                tokens=[tokens[r] for r in rids], load=other)


def run_config(cfg: str, prompt_sets: dict, out_len: int, probe, max_other: float, retries: int,
               wait_s: float, repeats: int, quantization: str) -> dict:
    from engine import LLM
    dt, _, shape = cfg.partition(":")
    tp, threads = (int(x) for x in shape.split("x"))
    res = dict(config=cfg, dtype=DTYPES[dt], tp=tp, threads=threads, runs={})
    t0 = time.perf_counter()
    with LLM(MODEL, dtype=DTYPES[dt], tensor_parallel_size=tp, num_threads=threads,
             master_port=free_port(), kv_cache_memory=256 << 20, enable_prefix_caching=False,
             quantization=quantization) as llm:
        res["startup_s"] = time.perf_counter() - t0
        res["weight_bytes"] = llm.core.resident_bytes      # rank 0's, GGUF blocks included
        from engine import SamplingParams
        llm.generate(prompt_sets[max(prompt_sets)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        for b, prompts in prompt_sets.items():
            runs = []
            for _ in range(repeats):
                # Contention (other processes' CPU in the timed window) spoils a run: rerun, keep the cleanest.
                tries = []
                while True:
                    if wait_s:
                        waited = wait_quiet(wait_s)
                        if waited > 11:
                            log(f"{cfg} batch {b}: waited {waited:.0f} s for the CPUs to go quiet")
                    tries.append(run_batch(llm, prompts, out_len, probe))
                    other = tries[-1]["load"]["other_cores"]
                    if other <= max_other or len(tries) > retries:
                        break
                    log(f"{cfg} batch {b}: other processes used {other:.2f} cores, again")
                r = min(tries, key=lambda t: t["load"]["other_cores"])
                r["reruns"] = len(tries) - 1
                runs.append(r)
                log(f"{cfg} batch {b}: {r['decode_tok_s']:.1f} tok/s decode, step {r['step_ms']:.1f} ms "
                    f"(forward {r['fwd_ms']:.1f}, collectives {r['comm_ms']:.1f}); other processes "
                    f"{r['load']['other_cores']:.2f} cores")
            best = max(runs, key=lambda t: t["decode_tok_s"])     # noise only slows a run
            best.update(all_tok_s=[t["decode_tok_s"] for t in runs], reruns=sum(t["reruns"] for t in runs),
                        other_max=max(t["load"]["other_cores"] for t in runs),
                        repeatable=all(t["tokens"] == runs[0]["tokens"] for t in runs))
            res["runs"][b] = best
    return res


# -------------------------------------------------------------------- gloo alone (2 fresh processes)

def time_case(case: dict, budget: float, max_iters: int) -> dict:
    """Time one collective on this rank (call inside the 2-rank group): warm-up,
    then N calls (N from the warm-up's pace, rank 0's N on both ranks), each
    timed on both ranks. With case["compute"] = (k, n), every call follows a
    matmul [batch, k] x [k, n] (untimed), as each of a decode step's
    all-reduces follows some of a layer's matmuls."""
    import torch
    import torch.distributed as dist
    dtype = getattr(torch, case["dtype"], torch.uint8)
    if case["op"] == "broadcast_object_list":
        obj = bytes(case["numel"]) if dist.get_rank() == 0 else None

        def call():
            dist.broadcast_object_list([obj], src=0)
        nbytes = case["numel"]
    elif case["op"] == "all_reduce":
        x = torch.zeros(case["numel"], dtype=dtype)       # zeros: sums never overflow nor go subnormal

        def call():
            dist.all_reduce(x)
        nbytes = x.numel() * x.element_size()
    else:
        x = torch.zeros(case["numel"], dtype=dtype)
        parts = [torch.empty_like(x) for _ in range(2)]

        def call():
            dist.all_gather(parts, x)
        nbytes = 2 * x.numel() * x.element_size()         # the gathered output
    work = None
    if case.get("compute"):
        k, n = case["compute"]
        a, w = torch.randn(case["batch"], k, dtype=dtype), torch.randn(k, n, dtype=dtype) / k ** 0.5
        work = functools.partial(torch.mm, a, w)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(10):
        if work:
            work()
        call()
    per = (time.perf_counter() - t0) / 10
    iters = torch.tensor([min(max_iters, max(20, int(budget / max(per, 1e-7))))])
    dist.broadcast(iters, 0)
    times = torch.empty(int(iters), dtype=torch.float64)
    dist.barrier()
    for i in range(len(times)):
        if work:
            work()
        t = time.perf_counter()
        call()
        times[i] = time.perf_counter() - t
    both = [torch.empty_like(times) for _ in range(2)]
    dist.all_gather(both, times)
    slow = torch.stack(both).max(0).values
    q = torch.quantile(slow, torch.tensor([0.5, 0.9], dtype=torch.float64)).tolist()
    return dict(case, bytes=nbytes, iters=len(times), median_us=q[0] * 1e6, p90_us=q[1] * 1e6,
                mean_us=float(slow.mean()) * 1e6, rank0_mean_us=float(both[0].mean()) * 1e6,
                rank0_median_us=float(both[0].median()) * 1e6)


def gloo_worker(args) -> int:
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=2,
                            timeout=timedelta(seconds=120))
    try:
        out = [time_case(c, args.budget, args.max_iters) for c in json.loads(args.cases)]
        if args.rank == 0:
            print("RESULT " + json.dumps(out), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


def run_gloo(cases: list[dict], budget: float, max_iters: int, timeout: float = 300) -> tuple[list, dict]:
    """The cases' results (a throwaway hidden-size all-reduce first: the first
    calls after the rendezvous are slow), and other processes' CPU meanwhile."""
    init = f"tcp://127.0.0.1:{free_port()}"
    cases = [dict(cases[0], what="warm-up, dropped")] + cases
    argv = [sys.executable, str(Path(__file__).resolve()), "--gloo-worker", "--init", init, "--budget", str(budget),
            "--max-iters", str(max_iters), "--cases", json.dumps(cases)]
    load = OtherLoad().start()
    procs = [subprocess.Popen(argv + ["--rank", str(r)], stdout=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a gloo rank failed: exit codes {[p.returncode for p in procs]}")
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])[1:], load.stop()


def gloo_cases(hidden: int, vocab: int, dtypes: list[str], batches: list[int], plan_bytes: dict,
               compute: tuple[int, int]) -> list[dict]:
    half = -(-vocab // 2)
    cs = []
    for dt in dtypes:
        for b in batches:
            cs.append(dict(op="all_reduce", dtype=dt, numel=b * hidden, batch=b,
                           what=f"{b} x {hidden} {dt}: o_proj / down_proj / embedding, batch {b}"))
            cs.append(dict(op="all_gather", dtype=dt, numel=b * half, batch=b,
                           what=f"{b} x {half} {dt} per rank: LM head logits, batch {b}"))
        for b in batches:
            cs.append(dict(op="all_reduce", dtype=dt, numel=b * hidden, batch=b, compute=compute,
                           what=f"{b} x {hidden} {dt}, each after a [{b}, {compute[0]}] x [{compute[0]}, "
                                f"{compute[1]}] matmul (untimed): as in a decode step"))
    for b in batches:
        n = plan_bytes.get(b) or 4096
        cs.append(dict(op="broadcast_object_list", dtype="pickle", numel=n, batch=b,
                       what=f"a {n} B object (the batch-{b} decode step plan's pickle size)"))
    return cs


def between(cfg: dict) -> tuple[int, int]:
    """(k, n) of a matmul with the weights one rank multiplies between two of a
    decode step's all-reduces at TP=2, on average: half a decoder layer's
    q/k/v/o and gate/up/down shards, as one [hidden, n] matrix."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d, nq, nkv = cfg.get("head_dim", 256), cfg["num_attention_heads"], cfg.get("num_key_value_heads", 1)
    per_layer = h * d * (nq // 2 + 2 * max(nkv // 2, 1)) + (nq // 2) * d * h + 3 * h * (i // 2)
    return h, per_layer // 2 // h


# -------------------------------------------------------------------- report

def report(args, results, gloo, gloo_load, started, cfg, load0, load1, busy0, busy1) -> str:
    import torch

    from server.bench import machine_info, machine_line
    hidden, L, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    cmd = ".venv/bin/python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0]))] + sys.argv[1:])
    tries = sum(run["reruns"] for r in results for run in r["runs"].values())
    base = {r["dtype"]: r for r in results if r["tp"] == 1 and r["threads"] == 2}
    out = [f"# Tensor-parallel decode: {MODEL}, TP=1 vs TP=2 on this CPU ({started})", "",
           f"Command: `{cmd}`", "", f"Code: {code_state()}.", "",
           f"Machine: {machine_line(machine_info())}; {kernel_line()}; torch {torch.__version__}; "
           "both ranks on this machine, "
           f"gloo over loopback (rendezvous 127.0.0.1, GLOO_SOCKET_IFNAME="
           f"{os.environ.get('GLOO_SOCKET_IFNAME') or 'unset'}).",
           f"Model: {MODEL} (the GGUF package's Q4_K_M weights, "
           + ("dequantized to the run's dtype" if args.quantization == "none" else
              f"--quantization {args.quantization}: the file's blocks, each rank its part")
           + f"): {L} layers, hidden "
           f"{hidden}, {cfg['num_attention_heads']} query heads / {cfg.get('num_key_value_heads')} KV head(s) "
           f"(TP=2: 2 query heads per rank, the KV head on both), MLP {cfg['intermediate_size']}, vocab {vocab} "
           f"(tied embedding / LM head: {vocab * hidden * 4 / 2**20:.0f} MiB in fp32, the bulk of the weights).",
           f"Load average (1 min) at start {load0:.2f}, at end {load1:.2f}. "
           + ("Busy processes at start (ps lifetime %CPU >= 20): " + "; ".join(busy0) + ". " if busy0 else
              "No other busy process at start. ")
           + ("At end: " + "; ".join(busy1) + "." if busy1 else "None at end.")
           + " Per run, the `other procs` column is the CPU other processes used during its timed window "
             f"(cores, from /proc); a run above {args.max_other_cores:g} cores was rerun (at most "
             f"{args.retries} times, the cleanest kept): {tries} rerun(s) in all"
           + (f"; before each timed run the script waited up to {args.wait_quiet:g} s for other processes to go "
              "idle (under 0.15 cores for 2 x 5 s)." if args.wait_quiet else "."), "",
           "## 1. Decode tokens/s", "",
           f"{args.output_len} output tokens per request, greedy, ignore_eos; prompts of {args.prompt_len} tokens "
           "(tinyshakespeare slices, the same in every config); batch B = B requests added at once. Decode "
           "tok/s = tokens after the step in which every request had its first token / time from the end of that "
           "step to the end of the last one (prefill excluded). Step = median decode step (`LLM.step()`: "
           "schedule, plan broadcast, forward, sample, detokenize); forward = rank 0's `ModelRunner.forward` "
           "in it (collectives included). Each config and batch ran "
           f"{args.repeats} time(s): decode tok/s is the fastest run (noise only slows a run), `runs` all of them, "
           "step / forward / collectives the fastest run's; `ratio` = decode tok/s / TP=1 with 2 threads, same "
           "dtype and batch. Greedy: requests whose tokens differ from TP=1 with 2 threads (same dtype and "
           "batch) / requests, and where each first differs (token index); * = the repeats' tokens differed. "
           "`other procs` = the most CPU other processes used during one of the kept runs.", "",
           "| dtype | ranks x threads | batch | decode tok/s | runs | ratio | step ms | forward ms | collectives "
           "ms (rank 0) | greedy vs TP=1 | other procs (cores) | startup s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for b, run in r["runs"].items():
            ref = base.get(r["dtype"])
            ratio = run["decode_tok_s"] / ref["runs"][b]["decode_tok_s"] if ref and r is not ref else None
            if ref and r is not ref:
                diff = [i for i, (x, y) in enumerate(zip(run["tokens"], ref["runs"][b]["tokens"])) if x != y]
                first = [next(j for j, (u, v) in enumerate(zip(run["tokens"][i], ref["runs"][b]["tokens"][i]))
                              if u != v) for i in diff]
                greedy = f"{len(diff)}/{len(run['tokens'])}" + (f" (at {', '.join(map(str, first))})" if diff else "")
            else:
                greedy = "(reference)"
            greedy += "" if run["repeatable"] else " *"
            comm = f"{run['comm_ms']:.1f}" if r["tp"] > 1 else "-"
            out.append(f"| {r['dtype']} | {r['tp']} x {r['threads']} | {b} | {run['decode_tok_s']:.2f} | "
                       f"{', '.join(f'{x:.2f}' for x in run['all_tok_s'])} | "
                       f"{'-' if ratio is None else f'{ratio:.2f}x'} | {run['step_ms']:.1f} | {run['fwd_ms']:.1f} | "
                       f"{comm} | {greedy} | {run['other_max']:.2f} | {r['startup_s']:.0f} |")
    out += [""]
    for dtype, ref in base.items():
        runs = ref["runs"]
        if len(runs) > 1:
            b0, b1 = min(runs), max(runs)
            x, y = runs[b0]["tokens"][0], runs[b1]["tokens"][0]
            j = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
            out.append(f"Batch invariance at TP=1 ({dtype}, 2 threads): request 0's tokens at batch {b1} vs "
                       f"batch {b0}: "
                       + ("identical." if j is None else f"first differ at token {j}."))
    out += ["", "Startup (s) is `LLM(...)` to ready (opening the file, the 262k-token tokenizer, the weights; "
            "both ranks, concurrently at TP=2), not measured in tok/s.", ""]

    # ---- 2
    tp2 = [r for r in results if r["tp"] == 2]
    out += ["## 2. Collectives per decode step at TP=2", ""]
    if tp2:
        out += ["Expected from `model_zoo/gemma3.py` + `parallel/linear.py`: per layer one all-reduce after "
                f"`o_proj` and one after `down_proj` (RowParallelLinear), x {L} layers = {2 * L}; the "
                "vocab-parallel embedding's all-reduce: 1; the LM head's all-gather of each rank's vocab/2 "
                "logits: 1; plus the step plan, one `broadcast_object_list` from rank 0 (engine/follower.py; "
                "torch issues it as 2 gloo broadcasts, the pickle's size then its bytes). All-reduces "
                f"{2 * L + 1}, all-gathers 1, plan broadcasts 1 per step, whatever the batch (the batch "
                "scales their size). Counted on rank 0 over the decode steps of each run (calls per step, "
                "bytes per call):", "",
                "| dtype | ranks x threads | batch | all_reduce | all_gather | broadcast_object_list (plan) |",
                "|---|---|---|---|---|---|"]
        for r in tp2:
            for b, run in r["runs"].items():
                cells = []
                for op in CommProbe.OPS:
                    c = run["comm"][op]
                    nb = c["bytes_per_call"] or [0]
                    size = f"{nb[0]:,}" + (f"-{nb[-1]:,}" if nb[-1] != nb[0] else "")
                    cells.append(f"{'/'.join(map(str, c['calls_per_step']))} x {size} B, {c['median_ms']:.2f} ms")
                out.append(f"| {r['dtype']} | {r['tp']} x {r['threads']} | {b} | " + " | ".join(cells) + " |")
        out += ["", "ms = median time per step inside those calls on rank 0 (waiting for rank 1 included). The "
                "plan grows with the sequences' block tables and positions (a range of sizes).", ""]

    # ---- 3
    k, n = between(cfg)
    out += ["## 3. The same collectives alone (2 fresh gloo processes, 1 thread each)", "",
            f"Each message: 10 warm-up calls, then up to {args.gloo_max_iters} timed calls (~{args.gloo_budget:g} s), "
            "each timed on both ranks; median, mean and p90 of the slower rank's time per call (as "
            "tests/bench/tp_comm.py), and rank 0's own mean (what section 2 measures in the engine). A "
            "throwaway all-reduce ran first (the first calls after the rendezvous are slow). `after a matmul`: "
            f"each call follows an untimed [batch, {k}] x [{k}, {n}] matmul ({k * n / 1e6:.2f} M weights: half "
            "of one rank's share of a decoder layer, what a rank multiplies between two all-reduces on "
            "average), so the ranks compute between collectives as they do in a decode step. Other "
            f"processes used {gloo_load['other_cores']:.2f} cores meanwhile ({gloo_load['reruns']} rerun(s)).", "",
            "| collective | message | bytes | iters | median us | mean us | p90 us | rank 0 mean us |",
            "|---|---|---|---|---|---|---|---|"]
    for g in gloo:
        out.append(f"| {g['op']} | {g['what']} | {g['bytes']:,} | {g['iters']} | {g['median_us']:.1f} | "
                   f"{g['mean_us']:.1f} | {g['p90_us']:.1f} | {g['rank0_mean_us']:.1f} |")
    out += [""]
    if tp2:
        out += ["## 4. Communication vs step time", "",
                "Predicted communication per step = the calls counted in section 2 x section 3's times for the "
                "same sizes: `back-to-back` with the slower rank's mean of the plain cases, `after compute` "
                "with rank 0's mean of the all-reduces that follow a matmul (all-gather and plan as "
                "back-to-back). `rank 0 in collectives` = measured in the engine (section 2). `rest` = step - "
                "rank 0 in collectives: rank 0's compute and host work. TP=1 step: same dtype and batch, "
                "2 threads.", "",
                "| dtype | ranks x threads | batch | step ms | predicted comm ms, back-to-back | predicted comm "
                "ms, after compute | rank 0 in collectives ms | comm share of step | rest ms | TP=1 step ms |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in tp2:
            for b, run in r["runs"].items():
                pb, pc = predicted(run, gloo, r["dtype"], b)
                ref = base.get(r["dtype"])
                f = lambda x: "-" if x is None else f"{x:.1f}"
                out.append(f"| {r['dtype']} | {r['tp']} x {r['threads']} | {b} | {run['step_ms']:.1f} | {f(pb)} | "
                           f"{f(pc)} | {run['comm_ms']:.1f} | {run['comm_ms'] / run['step_ms']:.0%} | "
                           f"{run['step_ms'] - run['comm_ms']:.1f} | "
                           + (f"{ref['runs'][b]['step_ms']:.1f} |" if ref else "- |"))
        out += [""]
    out += reading(results, base, gloo)
    return "\n".join(out)


def gloo_case(gloo, op, dtype, b, compute=False):
    return next((g for g in gloo if g["op"] == op and g["batch"] == b and bool(g.get("compute")) == compute
                 and (op == "broadcast_object_list" or g["dtype"] == dtype)), None)


def predicted(run, gloo, dtype, b) -> tuple[float | None, float | None]:
    """ms of communication per step from the alone timings: back-to-back, and
    with the all-reduces timed after a matmul."""
    n = {op: (run["comm"][op]["calls_per_step"] or [0])[-1] for op in CommProbe.OPS}
    plain = [gloo_case(gloo, op, dtype, b) for op in CommProbe.OPS]
    after = gloo_case(gloo, "all_reduce", dtype, b, compute=True)
    if None in plain:
        return None, None
    back = sum(n[op] * g["mean_us"] for op, g in zip(CommProbe.OPS, plain)) / 1e3
    if after is None:
        return back, None
    return back, back + n["all_reduce"] * (after["rank0_mean_us"] - plain[0]["mean_us"]) / 1e3


def reading(results, base, gloo) -> list[str]:
    """The numbers above in sentences: why TP=2 is as fast as it is here."""
    out = ["## Reading", ""]
    for dtype in sorted({g["dtype"] for g in gloo if g["op"] == "all_reduce"}):
        g = gloo_case(gloo, "all_reduce", dtype, 1)
        if g:
            out.append(f"- gloo alone, {dtype}: an all-reduce of one {g['numel']}-value row takes "
                       f"{g['median_us']:.0f} us "
                       f"(median) but {g['p90_us']:.0f} us at p90, {g['mean_us']:.0f} us on average (the slower "
                       "rank's time): a decode step's all-reduces cost their count x that mean, not x the median.")
    for dtype, ref in base.items():
        one = next((r for r in results if r["dtype"] == dtype and r["tp"] == 1 and r["threads"] == 1), None)
        for b, rr in ref["runs"].items():
            gbs = ref["weight_bytes"] / (rr["step_ms"] / 1e3) / 1e9
            s = (f"- {dtype}, batch {b}: TP=1 with 2 threads decodes {rr['decode_tok_s']:.2f} tok/s, a "
                 f"{rr['step_ms']:.0f} ms step, i.e. the {ref['weight_bytes'] / 2**20:.0f} MiB of weights read at "
                 f"{gbs:.1f} GB/s")
            if one:
                o = one["runs"][b]
                s += (f"; TP=1 with 1 thread: {o['decode_tok_s']:.2f} tok/s (2 threads / 1 thread = "
                      f"{rr['decode_tok_s'] / o['decode_tok_s']:.2f}x)")
            out.append(s + ".")
            for r in results:
                if r["dtype"] != dtype or r["tp"] == 1:
                    continue
                run = r["runs"][b]
                ratio = run["decode_tok_s"] / rr["decode_tok_s"]
                n_ar = (run["comm"]["all_reduce"]["calls_per_step"] or [0])[-1]
                ar = gloo_case(gloo, "all_reduce", dtype, b)
                arc = gloo_case(gloo, "all_reduce", dtype, b, compute=True)
                rest = run["step_ms"] - run["comm_ms"]
                out.append(
                    f"  - TP=2 with {r['threads']} thread(s) per rank: {run['decode_tok_s']:.2f} tok/s, "
                    f"{ratio:.2f}x ({abs(1 - ratio):.0%} {'slower' if ratio < 1 else 'faster'}); step "
                    f"{run['step_ms']:.0f} ms, of which rank 0 waits {run['comm_ms']:.0f} ms in "
                    f"{n_ar + 2} collectives per step ({n_ar} all-reduces"
                    + (f", {run['comm']['all_reduce']['median_ms'] / max(n_ar, 1) * 1e3:.0f} us each on average "
                       f"in the engine vs {ar['mean_us']:.0f} us alone back-to-back (median {ar['median_us']:.0f})"
                       if ar else "")
                    + (f" and {arc['rank0_mean_us']:.0f} us alone after a matmul" if arc else "")
                    + f"; the LM-head all-gather {run['comm']['all_gather']['median_ms']:.1f} ms; the plan "
                    f"{run['comm']['broadcast_object_list']['median_ms']:.1f} ms). Without them the step would be "
                    f"{rest:.0f} ms, {rest / rr['step_ms']:.2f}x TP=1's: each rank reads "
                    f"{r['weight_bytes'] / 2**20:.0f} MiB of weights.")
    return out + [""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="f32:1x2,f32:1x1,f32:2x1,f32:2x2,bf16:1x2,bf16:2x1",
                    help="DTYPE:TPxTHREADS,... (DTYPE f32 | bf16; THREADS torch threads per rank)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per config and batch; the fastest is reported")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gloo-budget", type=float, default=1.0, help="seconds of timed calls per message (about)")
    ap.add_argument("--gloo-max-iters", type=int, default=500)
    ap.add_argument("--max-other-cores", type=float, default=0.1,
                    help="rerun a batch whose timed window saw other processes use more CPU than this (cores)")
    ap.add_argument("--retries", type=int, default=2, help="reruns at most per batch; the cleanest run is kept")
    ap.add_argument("--wait-quiet", type=float, default=0.0,
                    help="before each timed run, wait up to this many seconds for other processes to go idle")
    ap.add_argument("--quick", action="store_true", help="16 tokens, f32 1x2 and 2x1, 0.2 s per message")
    ap.add_argument("--quantization", default="none",
                    help="none (the weights dequantized to the run's dtype, as the README's table) or gguf "
                         "(the file's Q4_K_M blocks, each rank its part)")
    ap.add_argument("--out", type=Path, default=OUT / "tp_decode.md")
    ap.add_argument("--gloo-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--init", help=argparse.SUPPRESS)
    ap.add_argument("--cases", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--max-iters", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.gloo_worker:
        return gloo_worker(args)
    if args.quick:
        args.output_len, args.configs, args.gloo_budget, args.repeats = 16, "f32:1x2,f32:2x1", 0.2, 1
    import logging
    logging.basicConfig(level=logging.WARNING)
    from model_zoo.resolve import open_model
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    load0, busy0 = os.getloadavg()[0], busy_now()
    src = open_model(MODEL, weights=False)
    cfg = src.config
    batches = [int(b) for b in args.batches.split(",")]
    pool = make_prompts(src.tokenizer, max(batches), args.prompt_len, args.prompt_len, args.seed)
    prompt_sets = {b: pool[:b] for b in batches}
    probe = CommProbe()
    results = []
    for c in args.configs.split(","):
        log(f"{c} ...")
        results.append(run_config(c, prompt_sets, args.output_len, probe, args.max_other_cores, args.retries,
                                  args.wait_quiet, args.repeats, args.quantization))
    plan_bytes = {}
    for r in results:
        for b, run in r["runs"].items():
            if run["plan_bytes"]:
                plan_bytes[b] = max(plan_bytes.get(b, 0), run["plan_bytes"])
    dtypes = sorted({r["dtype"] for r in results if r["tp"] > 1}) or ["float32"]
    cases = gloo_cases(cfg["hidden_size"], cfg["vocab_size"], dtypes, batches, plan_bytes, between(cfg))
    tries = []
    while True:
        if args.wait_quiet:
            wait_quiet(args.wait_quiet)
        log("gloo alone ...")
        tries.append(run_gloo(cases, args.gloo_budget, args.gloo_max_iters))
        if tries[-1][1]["other_cores"] <= args.max_other_cores or len(tries) > args.retries:
            break
        log(f"gloo alone: other processes used {tries[-1][1]['other_cores']:.2f} cores, again")
    gloo, gloo_load = min(tries, key=lambda t: t[1]["other_cores"])
    gloo_load["reruns"] = len(tries) - 1
    load1, busy1 = os.getloadavg()[0], busy_now()
    text = report(args, results, gloo, gloo_load, started, cfg, load0, load1, busy0, busy1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    print(text)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
