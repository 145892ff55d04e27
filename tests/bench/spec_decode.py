"""Speculative decoding with n-gram (prompt lookup) drafts on SmolLM2-135M-Instruct:
output tok/s without vs with speculation on input-grounded chat tasks, in one
run on one machine.

    .venv/bin/python tests/bench/spec_decode.py [--num-prompts 20] [--max-tokens 160] \
        [--concurrency 1,8] [--k 4] [--prompt-lookup-min 2] [--prompt-lookup-max 4] \
        [--temp-concurrency 1] [--sweep-batch 1,2,4,8,16] [--repeats 1] [--threads N]

Workload: chat-template prompts (SmolLM2's own template, 150-600 tokens) whose
answer repeats much of the input, where prompt lookup has something to find,
cycling over three tasks: (a) rewrite a passage fixing its spelling mistakes
(made-up passages written below and tinyshakespeare slices, typos injected
deterministically); (b) quote word for word what one speaker says in a
tinyshakespeare scene, or summarise a made-up passage quoting its key
sentence; (c) fix a Python function of this repository with one injected bug
(an operator flipped) and return the corrected code. Stops at EOS or
--max-tokens.

Concurrency c = c users, closed loop: one engine per (c, config) with
max_num_seqs=c and every request submitted at once, so the scheduler keeps c
requests running and starts the next one as soon as one finishes (what
`tqserve bench serve --max-concurrency c` does to a server, without the
HTTP). At least 2c requests per c: the prompt list is cycled when
--num-prompts is smaller. Each engine does one short request before the
timed runs. Prefix caching is off so that repeats are alike.

For each c: greedy without speculation, greedy with ngram for each --k
(speedup = tok/s on / tok/s off; mean acceptance length = 1 + accepted /
drafts, vLLM's; draft acceptance rate = accepted / drafted tokens), and the
greedy outputs compared request by request (speculation must not change
them: mismatches should be 0; the off-vs-off column compares the same
prompts' outputs at c and at the smallest c, the batch-shape numerics floor).
At --temp-concurrency: the same at temperature 0.7, seeded per request (its
outputs may differ: rejection sampling draws differently). --sweep-batch:
greedy off vs on (first --k) at more concurrencies, and a recommendation for
speculative_config's disable_by_batch_size: the largest swept c up to which
every swept c had speedup >= --min-speedup.

With --repeats N the configurations of one c run interleaved (off, on, off,
on, ...) and each row keeps its fastest run (a shared machine's noise only
slows runs down); all runs are in the JSON.

Writes tests/bench/results/spec_decode.{json,md} (--out to rename).
"""
import argparse
import ast
import gc
import hashlib
import json
import os
import random
import re
import shlex
import subprocess
import sys
import textwrap
import time

from bench_paths import DATA, OUT, ROOT, log  # puts the repo on sys.path

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 1024
TASKS = ("rewrite", "quote", "code")

# -- workload ------------------------------------------------------------------------------------------
PASSAGES = [
    "The lighthouse on Gull Point was built in 1871 from granite quarried on the island itself. For most of "
    "its working life it was kept by a single family, the Marrows, who trimmed the wick every four hours and "
    "wound the clockwork that turned the great lens. In winter the keeper's children rowed across the bay to "
    "school, and when the fog came down they stayed with relatives in the village until it lifted. The light "
    "was automated in 1962, and the last keeper, Edith Marrow, moved to the mainland with a brass logbook "
    "that recorded every ship she had seen pass. Today the tower is a small museum. Visitors can climb the "
    "ninety-two steps to the lantern room, where the original lens still turns, and on a clear evening the "
    "beam can be seen from the harbour twenty miles away.",
    "Making a sourdough loaf takes patience more than skill. The night before baking, feed the starter with "
    "equal weights of flour and water and leave it somewhere warm. In the morning, mix the flour and water "
    "for the dough and let them rest for an hour before adding the starter and the salt. Over the next few "
    "hours, stretch and fold the dough every thirty minutes; it will slowly become smooth and elastic. When "
    "it has grown by about half, shape it into a tight ball, place it in a floured basket and leave it in "
    "the fridge overnight. The cold slows the yeast and deepens the flavour. Bake the loaf in a very hot "
    "covered pot for twenty minutes, then remove the lid and bake for another twenty five minutes, until the "
    "crust is dark brown and the loaf sounds hollow when tapped underneath.",
    "The city's first tram line opened in 1894 and ran from the railway station to the cathedral square, a "
    "distance of just under three kilometres. The cars were pulled by horses for the first six years, until "
    "the line was electrified and extended across the river to the new suburbs in the east. By 1930 the "
    "network had eleven lines and carried more passengers than the buses and the railway combined. Most of "
    "it was closed in the 1960s, when the council decided that buses were cheaper to run and easier to "
    "reroute. Only the line along the river survived, largely because the road beside it was too narrow for "
    "buses. In 2011 the city began to rebuild the network, and the new trams, which are low-floor and run on "
    "the old routes, now carry over a hundred thousand people every day.",
    "Version 2.4 of the library changes how configuration files are loaded. Previously, the loader searched "
    "the current directory, then the user's home directory, and used the first file it found. It now reads "
    "every file it finds and merges them, with values from the current directory taking precedence over "
    "values from the home directory. Keys that are not recognised now produce a warning instead of being "
    "silently ignored, and the warning names the file and the line where the key was found. The deprecated "
    "option for disabling colour output has been removed; set the environment variable instead. Finally, "
    "the command that prints the effective configuration now shows, next to each value, the file it came "
    "from, which should make it much easier to understand why a setting does not have the value you expect.",
    "Every autumn, millions of small songbirds leave northern Europe and fly south to spend the winter in "
    "Africa. Many of them travel at night, when the air is cooler and calmer and there are fewer predators "
    "about. They find their way using several cues at once: the position of the setting sun, the pattern of "
    "the stars around the pole, and the Earth's magnetic field, which some birds appear to sense through "
    "special proteins in their eyes. Young birds making the journey for the first time seem to be born with "
    "a direction and a distance to fly, and they correct their course as they gain experience. Before "
    "leaving, the birds eat so much that they can almost double their weight, and this fat is the fuel that "
    "carries them across the sea and the desert, where there is almost nothing to eat.",
]

REWRITE = "Rewrite the following paragraph, fixing the spelling mistakes. Change nothing else.\n\n{text}"
REWRITE_PLAY = ("Rewrite the following scene from a play, fixing the spelling mistakes. Keep the speakers' "
                "names and the line breaks.\n\n{text}")
QUOTE = ("Here is a scene from a play. Quote, word for word and in order, every line that {speaker} "
         "speaks in it.\n\n{text}")
SUMMARY = ("Summarise the following text in a few sentences, keeping its wording where you can, and then "
           "quote its most important sentence exactly.\n\n{text}")
CODE = ("The following Python function has a bug. Find it and return the corrected function, complete, in a "
        "single ```python code block.\n\n```python\n{text}\n```")

# Bugs to inject into a function, tried in turn (from a per-prompt starting point); the first that
# occurs is applied once.
MUTATIONS = [(" <= ", " < "), (" + 1", " - 1"), (" >= ", " > "), (" == ", " != "), ("min(", "max("),
             (" - 1", " + 1"), (" and ", " or "), (" < ", " <= "), ("[-1]", "[0]"), (" > ", " >= ")]
CODE_DIRS = ("engine", "kvcache", "model_zoo", "server", "tests/bench")


def add_typos(text, rng, rate=0.12):
    """Swap two inner letters or drop / double one in about `rate` of the words of 4+ letters."""
    def typo(m):
        w = m.group(0)
        if len(w) < 4 or rng.random() >= rate:
            return w
        i = rng.randrange(1, len(w) - 2)
        kind = rng.randrange(3)
        if kind == 0:
            return w[:i] + w[i + 1] + w[i] + w[i + 2:]
        if kind == 1:
            return w[:i] + w[i + 1:]
        return w[:i] + w[i] + w[i:]
    return re.sub(r"[A-Za-z]+", typo, text)


def play_scenes(rng, n, lo_chars, hi_chars):
    """n slices of tinyshakespeare that start at a speech and hold whole speeches, with their speakers."""
    text = DATA.read_text()
    starts = [m.start() for m in re.finditer(r"(?:^|\n\n)([A-Z][A-Za-z ]+):\n", text[:600_000])]
    out = []
    while len(out) < n:
        s = rng.choice(starts)
        s = s + 2 if text[s] == "\n" else s
        end = text.rfind("\n\n", s, s + hi_chars)
        if end - s < lo_chars:
            continue
        scene = text[s:end]
        speakers = re.findall(r"(?:^|\n\n)([A-Z][A-Za-z ]+):\n", scene)
        if len(set(speakers)) < 2:
            continue
        out.append((scene, speakers))
    return out


def repo_functions():
    """(path:qualname, source) of every function in the repo's Python under CODE_DIRS, sorted."""
    out = []
    for d in CODE_DIRS:
        for path in sorted((ROOT / d).glob("*.py")):
            try:
                src = path.read_text()
                tree = ast.parse(src)
            except (OSError, SyntaxError):
                continue
            stack = [(tree, "")]
            while stack:
                node, prefix = stack.pop()
                for ch in ast.iter_child_nodes(node):
                    if isinstance(ch, (ast.FunctionDef, ast.ClassDef)):
                        name = prefix + ch.name
                        if isinstance(ch, ast.FunctionDef):
                            seg = ast.get_source_segment(src, ch)
                            if seg:
                                # get_source_segment drops the first line's indent: give it back, dedent all.
                                indent = " " * ch.col_offset
                                out.append((f"{path.relative_to(ROOT)}:{name}", textwrap.dedent(indent + seg)))
                        stack.append((ch, name + "."))
    return sorted(out)


def code_lines(code):
    """Indices of the lines of a function that are code: its docstring and comment lines left out."""
    skip = set()
    try:
        fn = ast.parse(code).body[0]
        first = fn.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            skip = set(range(first.lineno - 1, first.end_lineno))
    except (SyntaxError, IndexError, AttributeError):
        pass
    return [i for i, ln in enumerate(code.split("\n")) if i not in skip and not ln.lstrip().startswith("#")]


def mutate(code, start):
    """One bug: the first of MUTATIONS (from `start` on) found in a code line (before any comment)."""
    lines = code.split("\n")
    where = code_lines(code)
    for j in range(len(MUTATIONS)):
        a, b = MUTATIONS[(start + j) % len(MUTATIONS)]
        for i in where:
            head, sep, tail = lines[i].partition("#")
            if a in head:
                lines[i] = head.replace(a, b, 1) + sep + tail
                return "\n".join(lines), f"{a.strip()!r} -> {b.strip()!r}, line {i + 1}"
    return None, None


def build_prompts(tok, template, n, seed, lo, hi):
    """n chat prompts (token ids) of lo..hi tokens, cycling rewrite / quote-or-summarise / code."""
    from model_zoo.chat_template import render_chat
    rng = random.Random(seed)

    def chat(user):
        text = render_chat(template, [{"role": "user", "content": user}], bos_token=tok.bos_token,
                           eos_token=tok.eos_token, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    per_task = -(-n // len(TASKS))
    pools = {t: [] for t in TASKS}

    def add(task, source, template, text):
        """text: what the task hands over to be worked on (the passage with typos, the buggy code)."""
        user = template.format(text=text)
        ids = chat(user)
        if lo <= len(ids) <= hi:
            pools[task].append({"task": task, "source": source, "ids": ids, "user": user, "text": text})

    # (a) rewrite: the made-up passages, then play scenes, with typos.
    for i, p in enumerate(PASSAGES):
        add("rewrite", f"passage {i}", REWRITE, add_typos(p, rng))
    scenes = play_scenes(rng, 4 * per_task, 500, 1500)
    for j, (scene, _) in enumerate(scenes[:per_task]):
        add("rewrite", f"tinyshakespeare scene {j}", REWRITE_PLAY, add_typos(scene, rng))
    # (b) quote one speaker of a scene, or summarise a passage; alternating.
    quotes = []
    for j, (scene, speakers) in enumerate(scenes[per_task:]):
        speaker = rng.choice(sorted(set(speakers)))
        ids = chat(QUOTE.format(speaker=speaker, text=scene))
        if lo <= len(ids) <= hi:
            quotes.append({"task": "quote", "source": f"tinyshakespeare scene {per_task + j}, {speaker}",
                           "ids": ids, "user": QUOTE.format(speaker=speaker, text=scene)})
    sums = []
    for i, p in enumerate(PASSAGES):
        ids = chat(SUMMARY.format(text=p))
        if lo <= len(ids) <= hi:
            sums.append({"task": "quote", "source": f"passage {i} (summary)", "ids": ids,
                         "user": SUMMARY.format(text=p)})
    for i in range(max(len(quotes), len(sums))):
        pools["quote"] += quotes[i:i + 1] + sums[i:i + 1]
    # (c) code: functions of this repository with one bug each.
    # In an order fixed by name and seed, so that functions added to the repo move few others.
    funcs = sorted(repo_functions(), key=lambda f: hashlib.sha256(f"{seed}:{f[0]}".encode()).hexdigest())
    for name, code in funcs:
        if len(pools["code"]) >= per_task:
            break
        bad, what = mutate(code, len(pools["code"]))
        if bad is None or not 60 <= len(tok.encode(bad, add_special_tokens=False)) <= min(hi - 80, 400):
            continue
        add("code", f"{name} ({what})", CODE, bad)
    # Interleave a, b, c, a, b, c, ...
    out = []
    for i in range(per_task):
        for t in TASKS:
            if i < len(pools[t]):
                out.append(pools[t][i])
    if len(out) < n:
        raise SystemExit(f"only {len(out)} prompts of {lo}-{hi} tokens could be built (asked for {n})")
    return out[:n]


# -- runs ----------------------------------------------------------------------------------------------
def spec_stats(llm):
    s = llm.core.get_stats()
    return {"drafts": s.spec_decode_num_drafts_total, "draft_tokens": s.spec_decode_num_draft_tokens_total,
            "accepted": s.spec_decode_num_accepted_tokens_total,
            "per_pos": list(s.spec_decode_num_accepted_tokens_per_pos), "steps": s.steps_total,
            "generation_tokens": s.generation_tokens_total}


def run(llm, prompts, params):
    """Submit every request at once, step until all are done; output tok/s over the whole run."""
    a = spec_stats(llm)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    rids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    done, running, n_tok, n_steps = {}, [], {r: 0 for r in rids}, {r: 0 for r in rids}
    while llm.core.has_work():
        outs = llm.step()
        finished = 0
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if n > n_tok[o.request_id]:          # a step that gave this request tokens
                n_tok[o.request_id], n_steps[o.request_id] = n, n_steps[o.request_id] + 1
            if o.finished:
                done[o.request_id] = o
                finished += 1
        # Requests that ran in this step: those still running (newly admitted included) + those it finished.
        running.append(len(llm.core.scheduler.running) + finished)
    dt = time.perf_counter() - t0
    b = spec_stats(llm)
    outs = [done[r].outputs[0] for r in rids]
    n_out = sum(len(o.token_ids) for o in outs)
    # Predicted outputs (predicted_outputs.py): accepted / rejected prediction tokens, summed.
    pred = [[done[r].metrics.get(f"{k}_prediction_tokens") for r in rids] for k in ("accepted", "rejected")]
    d = {k: b[k] - a[k] for k in ("drafts", "draft_tokens", "accepted", "steps", "generation_tokens")}
    per_pos = [y - x for x, y in zip(a["per_pos"], b["per_pos"])]
    return {"total_s": dt, "output_tokens": n_out, "output_tok_s": n_out / dt, "steps": d["steps"],
            "mean_running": sum(running) / max(len(running), 1), "loadavg_1min_before": load0,
            "spec": {**{k: d[k] for k in ("drafts", "draft_tokens", "accepted")}, "accepted_per_pos": per_pos,
                     "acceptance_length": 1 + d["accepted"] / d["drafts"] if d["drafts"] else None,
                     "acceptance_rate": d["accepted"] / d["draft_tokens"] if d["draft_tokens"] else None},
            "prediction": [sum(x or 0 for x in v) for v in pred] if any(x is not None for x in pred[0]) else None,
            "finish": [o.finish_reason for o in outs], "token_ids": [list(o.token_ids) for o in outs],
            "token_steps": [n_steps[r] for r in rids]}


def mismatches(a, b):
    """Requests whose token ids differ, with the first differing position."""
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            pos = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            out.append({"request": i, "first_diff": pos, "len_a": len(x), "len_b": len(y)})
    return out


def make_engine(c, spec, args):
    from engine import LLM
    kw = dict(max_num_seqs=c, max_model_len=MAX_MODEL_LEN, kv_cache_memory=max(256, 64 * c) << 20,
              enable_prefix_caching=False, dtype=args.dtype)
    if spec:
        kw["speculative_config"] = spec
    t = time.perf_counter()
    llm = LLM(MODEL, **kw)
    return llm, time.perf_counter() - t


def spec_config(k, args):
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max}


def bench_c(c, ks, temp, args, prompts, res):
    """Off and ngram(k) engines at concurrency c: greedy for each k, and temperature 0.7 (first k) if temp."""
    from engine import SamplingParams
    n = max(len(prompts), 2 * c)
    reqs = [prompts[i % len(prompts)]["ids"] for i in range(n)]
    greedy = [SamplingParams(temperature=0, max_tokens=args.max_tokens)] * n
    sampled = [SamplingParams(temperature=0.7, seed=args.seed + i, max_tokens=args.max_tokens) for i in range(n)]
    configs = {"off": None, **{f"ngram k={k}": spec_config(k, args) for k in ks}}
    engines = {}
    for name, spec in configs.items():
        llm, load_s = make_engine(c, spec, args)
        warm = run(llm, [reqs[0]], [SamplingParams(temperature=0, max_tokens=16)])
        engines[name] = llm
        log(f"c={c} {name}: engine loaded in {load_s:.1f} s, warm-up {warm['total_s']:.1f} s")
    todo = [(name, "greedy", greedy) for name in configs]
    if temp:
        todo += [(name, "t=0.7", sampled) for name in list(configs)[:2]]
    runs = {}
    for r in range(args.repeats):
        for name, mode, params in todo:
            out = run(engines[name], reqs, params)
            runs.setdefault((name, mode), []).append(out)
            sp = out["spec"]
            log(f"c={c} {name} {mode} run {r + 1}/{args.repeats}: {out['output_tokens']} tokens in "
                f"{out['total_s']:.1f} s = {out['output_tok_s']:.1f} tok/s, {out['steps']} steps, mean running "
                f"{out['mean_running']:.1f}" + (f", acceptance length {sp['acceptance_length']:.2f}, rate "
                                                f"{100 * sp['acceptance_rate']:.0f}%" if sp["drafts"] else ""))
    del engines
    gc.collect()
    rows = []
    for mode in ("greedy", "t=0.7") if temp else ("greedy",):
        off = runs[("off", mode)]
        best_off = max(off, key=lambda x: x["output_tok_s"])
        for name in list(configs)[1:] if mode == "greedy" else list(configs)[1:2]:
            on = runs[(name, mode)]
            best_on = max(on, key=lambda x: x["output_tok_s"])
            mm = mismatches(off[0]["token_ids"], on[0]["token_ids"])
            by_task = {}                          # task -> [tokens, steps that gave tokens], speculation on
            for i, (ids, st) in enumerate(zip(best_on["token_ids"], best_on["token_steps"])):
                t = by_task.setdefault(prompts[i % len(prompts)]["task"], [0, 0])
                t[0], t[1] = t[0] + len(ids), t[1] + st
            row = {"config": name, "k": int(name.split("=")[1]), "c": c, "mode": mode, "requests": n,
                   "tok_s_off": best_off["output_tok_s"], "tok_s_on": best_on["output_tok_s"],
                   "speedup": best_on["output_tok_s"] / best_off["output_tok_s"],
                   "acceptance_length": best_on["spec"]["acceptance_length"],
                   "acceptance_rate": best_on["spec"]["acceptance_rate"],
                   "accepted_per_pos": best_on["spec"]["accepted_per_pos"],
                   "drafts": best_on["spec"]["drafts"], "steps_off": best_off["steps"], "steps_on": best_on["steps"],
                   "output_tokens_off": best_off["output_tokens"], "output_tokens_on": best_on["output_tokens"],
                   "mismatches": len(mm) if mode == "greedy" else None,
                   "mismatch_detail": mm if mode == "greedy" else None,
                   "runs_tok_s_off": [x["output_tok_s"] for x in off], "runs_tok_s_on": [x["output_tok_s"] for x in on],
                   "runs_loadavg_before": [[x["loadavg_1min_before"] for x in off],
                                           [x["loadavg_1min_before"] for x in on]],
                   "mean_running_off": best_off["mean_running"], "mean_running_on": best_on["mean_running"],
                   "tokens_per_step_by_task": {t: a / b for t, (a, b) in by_task.items() if b}}
            rows.append(row)
            log(f"c={c} {name} {mode}: {row['tok_s_off']:.1f} -> {row['tok_s_on']:.1f} tok/s, speedup "
                f"{row['speedup']:.2f}x, acceptance length {fmt(row['acceptance_length'], 2)}"
                + (f", greedy mismatches {row['mismatches']}/{n}" if mode == "greedy" else ""))
    # Greedy outputs without speculation, per distinct prompt: the off-vs-off comparison across c.
    res.setdefault("greedy_off_tokens", {})[c] = runs[("off", "greedy")][0]["token_ids"][:len(prompts)]
    return rows


def recommend(sweep, min_speedup):
    """disable_by_batch_size: the largest swept c such that every swept c up to it had speedup >= min_speedup."""
    pays = None
    for r in sorted(sweep, key=lambda r: r["c"]):
        if r["speedup"] < min_speedup:
            break
        pays = r["c"]
    cs = sorted(r["c"] for r in sweep)
    trail = ", ".join(f"{r['speedup']:.2f}x at c={r['c']}" for r in sorted(sweep, key=lambda r: r["c"]))
    if pays is None:
        return None, (f"speculation does not pay even at c={cs[0]} here ({trail}): leave it off on this "
                      "machine and workload")
    if pays == cs[-1]:
        return pays, (f"disable_by_batch_size >= {pays} (or none): speculation paid at every swept concurrency "
                      f"({trail}); sweep higher to find where it stops")
    nxt = next(c for c in cs if c > pays)
    return pays, (f"disable_by_batch_size = {pays}: speculation pays (speedup >= {min_speedup:.2f}) up to "
                  f"{pays} running requests and not at {nxt} ({trail}); between {pays} and {nxt} is not measured")


# -- report --------------------------------------------------------------------------------------------
def fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def table(rows):
    L = ["| config | c | sampling | requests | tok/s off | tok/s on | speedup | acceptance length | "
         "acceptance rate | accepted per position | steps off / on | tokens per step, by task | greedy mismatches | "
         "off vs off (smallest c) |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mm = f"{r['mismatches']}/{r['requests']}" if r["mismatches"] is not None else "n/a (sampled)"
        oo = r.get("off_vs_off")
        L.append(f"| {r['config']} | {r['c']} | {r['mode']} | {r['requests']} | {fmt(r['tok_s_off'])} | "
                 f"{fmt(r['tok_s_on'])} | {r['speedup']:.2f}x | {fmt(r['acceptance_length'], 2)} | "
                 f"{fmt(None if r['acceptance_rate'] is None else 100 * r['acceptance_rate'], 0)}% | "
                 f"{r['accepted_per_pos']} (of {r['drafts']} drafts) | {r['steps_off']} / {r['steps_on']} | "
                 f"{', '.join(f'{t} {v:.2f}' for t, v in r['tokens_per_step_by_task'].items())} | {mm} | "
                 f"{'-' if oo is None else f'{oo[0]}/{oo[1]}'} |")
    return L


AUTO_DTYPE = " (engine/auto_defaults.py: bf16 on a CPU with bf16 arithmetic, else fp32)"


def write_md(res, args):
    from server.bench import machine_line
    m = res["machine"]
    p = res["prompts_summary"]
    L = ["# Speculative decoding: n-gram (prompt lookup) drafts", "", f"Command: `{res['command']}`", "",
         f"SmolLM2-135M-Instruct (`LLM(\"{MODEL}\", max_num_seqs=c, max_model_len={MAX_MODEL_LEN}, "
         "enable_prefix_caching=False, speculative_config={\"method\": \"ngram\", \"num_speculative_tokens\": k, "
         f"\"prompt_lookup_min\": {args.prompt_lookup_min}, \"prompt_lookup_max\": {args.prompt_lookup_max}}})`), "
         f"dtype {args.dtype}{AUTO_DTYPE if args.dtype == 'auto' else ''}, on {res['device']}, "
         f"{m['torch_threads']} torch threads, torch {m['torch']}.", "",
         f"Machine: {machine_line(m)}; load average at start {m['loadavg_start'][0]:.2f}, at end "
         f"{m['loadavg_end'][0]:.2f}. Git {res['git']}.", "",
         f"Workload: {p['n']} chat prompts (SmolLM2's template), {p['min_tokens']}-{p['max_tokens']} tokens "
         f"(mean {p['mean_tokens']:.0f}), tasks {p['by_task']}: rewrite a passage fixing injected spelling "
         "mistakes, quote one speaker of a tinyshakespeare scene word for word or summarise a passage quoting its "
         "key sentence, fix one injected bug in a function of this repository (the prompts are in the JSON, "
         f"sha256 {p['sha256'][:16]}). Up to {args.max_tokens} output tokens, stop at EOS.", "",
         "Concurrency c: c users in a closed loop, i.e. one engine per (c, config) with max_num_seqs=c and every "
         "request submitted at once; the scheduler keeps c running and starts the next as one finishes (as "
         "`tqserve bench serve --max-concurrency c`, without HTTP). Requests per c: max(prompts, 2c), the prompt "
         "list cycled. tok/s = output tokens / wall time of the whole run (prefill included). "
         f"{'Fastest of ' + str(args.repeats) + ' interleaved runs per row (all runs in the JSON). ' if args.repeats > 1 else ''}"
         "Acceptance length = 1 + accepted / drafts (vLLM's); acceptance rate = accepted / drafted tokens. "
         "Greedy mismatches: requests whose tokens differ with speculation on (should be 0); off vs off: the same "
         "prompts without speculation at c and at the smallest c (float batch-shape noise, for reference). "
         "Tokens per step, by task: with speculation, a request's output tokens / the steps that gave it tokens "
         "(1.00 without; drafts that find no n-gram count as steps of one).", "",
         "## Main", ""]
    L += table(res["main"])
    if res.get("sweep"):
        L += ["", f"## Sweep (greedy, ngram k={res['sweep'][0]['k']}): where speculation stops paying", ""]
        L += table(res["sweep"])
        L += ["", f"Recommendation: {res['recommendation']}"]
    L += ["", f"Total run time {res['wall_s']:.0f} s."]
    return "\n".join(L) + "\n"


def ints(s):
    return [int(x) for x in re.split(r"[,\s]+", s.strip()) if x]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--min-len", type=int, default=150, help="prompt tokens, chat template included")
    ap.add_argument("--max-len", type=int, default=600)
    ap.add_argument("--concurrency", type=ints, default=[1, 8], help="comma list, e.g. 1,2,4,8,16")
    ap.add_argument("--k", "--num-speculative-tokens", dest="k", type=ints, default=[4],
                    help="draft lengths, comma list; the first is used for the t=0.7 row and the sweep")
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--temp-concurrency", type=ints, default=[1],
                    help="concurrencies of --concurrency that also get a temperature 0.7 (seeded) row; '' for none")
    ap.add_argument("--sweep-batch", type=ints, default=[],
                    help="also greedy off vs on (first --k) at these concurrencies, for disable_by_batch_size")
    ap.add_argument("--min-speedup", type=float, default=1.0, help="the sweep's 'pays' threshold")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved timed runs per config; rows keep the fastest")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--dtype", default="auto", help="the engine's dtype (auto: bf16 where the CPU computes in "
                                                     "bf16, else fp32; greedy mismatches are only 0 by design in "
                                                     "fp32)")
    ap.add_argument("--seed", type=int, default=0, help="prompt building and the t=0.7 requests' seeds")
    ap.add_argument("--out", default="spec_decode", help="results file stem in tests/bench/results")
    args = ap.parse_args()
    cmd = shlex.join([".venv/bin/python", "tests/bench/spec_decode.py", *sys.argv[1:]])
    t_start = time.perf_counter()
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    from server.bench import machine_info
    machine = {**machine_info(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
               "loadavg_start": list(os.getloadavg())}
    try:
        git = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        git = "?"
    res = {"command": cmd, "config": vars(args), "machine": machine, "git": git}
    log(f"machine: {machine}")

    from model_zoo.resolve import open_model
    src = open_model(MODEL)
    prompts = build_prompts(src.tokenizer, src.chat_template, args.num_prompts, args.seed, args.min_len, args.max_len)
    lens = [len(p["ids"]) for p in prompts]
    by_task = {t: sum(p["task"] == t for p in prompts) for t in TASKS}
    res["prompts_summary"] = {"n": len(prompts), "min_tokens": min(lens), "max_tokens": max(lens),
                              "mean_tokens": sum(lens) / len(lens), "by_task": by_task,
                              "sha256": hashlib.sha256(json.dumps([p["ids"] for p in prompts]).encode()).hexdigest()}
    res["prompts"] = [{"task": p["task"], "source": p["source"], "tokens": len(p["ids"]), "user": p["user"]}
                      for p in prompts]
    log(f"{len(prompts)} prompts, {min(lens)}-{max(lens)} tokens, {by_task}")

    cs = sorted(set(args.concurrency) | set(args.sweep_batch))
    res["main"], res["sweep"], by_c = [], [], {}
    for c in cs:
        ks = args.k if c in args.concurrency else args.k[:1]
        temp = c in args.concurrency and c in args.temp_concurrency
        log(f"c={c}: {', '.join(f'k={k}' for k in ks)}{', with t=0.7' if temp else ''} ...")
        by_c[c] = bench_c(c, ks, temp, args, prompts, res)
    # Off vs off against the smallest c, per distinct prompt.
    offs = res.pop("greedy_off_tokens")
    ref = offs[cs[0]]
    for c in cs:
        mm = mismatches(ref, offs[c])
        for r in by_c[c]:
            r["off_vs_off"] = (len(mm), len(ref)) if c != cs[0] else None
        if c in args.concurrency:
            res["main"] += by_c[c]
        if c in args.sweep_batch:
            res["sweep"] += [r for r in by_c[c] if r["mode"] == "greedy" and r["k"] == args.k[0]]
    res["device"] = "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name()
    if res["sweep"]:
        res["recommended_disable_by_batch_size"], res["recommendation"] = recommend(res["sweep"], args.min_speedup)
        log(f"recommendation: {res['recommendation']}")
    res["greedy_off_outputs_smallest_c"] = [src.tokenizer.decode(t) for t in ref]
    res["machine"]["loadavg_end"] = list(os.getloadavg())
    res["wall_s"] = time.perf_counter() - t_start
    OUT.mkdir(parents=True, exist_ok=True)
    md = write_md(res, args)
    (OUT / f"{args.out}.json").write_text(json.dumps(res, indent=2))
    (OUT / f"{args.out}.md").write_text(md)
    print(md)
    if "recommendation" in res:
        print(f"Recommendation: {res['recommendation']}")


if __name__ == "__main__":
    main()
