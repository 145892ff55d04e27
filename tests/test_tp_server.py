"""Tensor parallelism through the whole server: `tqserve serve
--tensor-parallel-size 2` answers the openai client (streaming, greedy) with
the tokens of one rank, for Gemma3-270M (real weights), a tiny Qwen3 and a
tiny DeepSeek-V4:

  (a) two ranks on one machine (the server starts its second rank);
  (b) two "nodes" (tiny Qwen3, tiny DeepSeek-V4): network namespaces joined
      by a veth pair, each with its own address; the leader in one serves
      HTTP, `tqserve serve --headless --node-rank 1` in the other, rendezvous
      and collectives over the link (DeepSeek-V4 with --async-scheduling: the
      leader shares each step's sampled tokens over it; and with its MTP
      head drafting: the head's passes broadcast after each step).

Faults (two nodes): the follower killed mid-stream ends the open streams with
an error event and the leader with a non-zero exit within 30 s; the leader
killed ends the follower within 30 s. A head count that does not divide is
one startup error naming the numbers, before any rank waits on another.

The client runs as its own process (tests/tp_client.py), so that it can run
inside the leader's namespace.
"""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import transformers
from netns import netns_unavailable, two_nodes
from test_deepseek_v4 import CONFIG as DSV4, case, hf_config, randomise, save_with_mtp
from test_server_process import REPO, ServerProcess, free_port
from tiny_models import save_tiny_qwen3, token_prompts

from engine import LLM, SamplingParams

N = 16
ENGINE = ["--kv-cache-memory", "16MiB", "--max-model-len", "256", "--max-num-seqs", "4"]
CLIENT = [sys.executable, str(REPO / "tests" / "tp_client.py")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    q = tmp_path_factory.mktemp("qwen3")
    save_tiny_qwen3(q)
    d = tmp_path_factory.mktemp("dsv4")
    hf = transformers.DeepseekV4ForCausalLM(hf_config(DSV4)).eval()
    randomise(list(hf.named_parameters()) + list(hf.named_buffers()), DSV4["n_routed_experts"],
              DSV4["num_experts_per_tok"])
    hf.save_pretrained(d)
    m = tmp_path_factory.mktemp("dsv4_mtp")
    save_with_mtp(case(4), m)
    return {"gemma3": "gemma3-270m", "qwen3": str(q), "dsv4": str(d), "dsv4_mtp": str(m)}


PROMPTS = {
    "gemma3": ["The capital of France is", "Here is a short poem about the sea:\n"],
    "qwen3": token_prompts(2, 5, 40, seed=3),
    "dsv4": [[t % DSV4["vocab_size"] for t in p] for p in token_prompts(2, 5, 40, seed=4)],
}
PROMPTS["dsv4_mtp"] = PROMPTS["dsv4"]
MTP = ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 2})]


@pytest.fixture(scope="module")
def references(models):
    """One rank, in this process: (texts, token ids, KV bytes per token) per model."""
    out = {}
    for name, model in models.items():
        with LLM(model, kv_cache_memory=16 << 20, max_model_len=256) as llm:
            res = llm.generate(PROMPTS[name], SamplingParams(temperature=0, max_tokens=N))
            out[name] = ([r.outputs[0].text for r in res], [list(r.outputs[0].token_ids) for r in res],
                         llm.core.plan.bytes_per_token)
    return out


KV_SPLIT = {"gemma3": 1, "qwen3": 2, "dsv4": 1}


def parse_client(stdout: str) -> list[dict]:
    line = stdout.strip().splitlines()[-1] if stdout.strip() else "{}"
    body = json.loads(line)
    assert "results" in body, body
    return body["results"]


def check_against_reference(name: str, results: list[dict], ref) -> None:
    texts, ids, _ = ref
    for r, text, toks in zip(results, texts, ids):
        assert r["error"] is None, r
        if name == "gemma3":             # a tokenizer: compare the text
            assert r["text"] == text, (r["text"], text)
        else:                            # token ids only: "token_id:N"
            assert [int(t.split(":")[1]) for t in r["tokens"]] == toks


def bytes_per_token(log: str) -> float:
    return float(re.search(r"KV cache \d+ tokens, ([0-9.]+) bytes/token", log).group(1))


# ---------------------------------------------------------------- (a) one node

@pytest.mark.parametrize("name", ["gemma3", "qwen3", "dsv4"])
def test_two_ranks_on_one_machine_match_one_rank(models, references, name, tmp_path):
    srv = ServerProcess(tmp_path / "server.log", "--model", models[name], "--tensor-parallel-size", "2",
                        "--master-port", str(free_port()), *ENGINE)
    try:
        out = subprocess.run([*CLIENT, srv.url, json.dumps(PROMPTS[name]), str(N)], capture_output=True,
                             text=True, timeout=300)
        check_against_reference(name, parse_client(out.stdout), references[name])
        log = srv.log()
        assert "x 2 tensor-parallel ranks" in log
        # Each rank holds its shard of the KV heads: Qwen3's two split, Gemma3's
        # one replicated, DeepSeek-V4's shared latent KV whole on every rank.
        per_rank = bytes_per_token(log)
        assert per_rank == references[name][2] / KV_SPLIT[name], per_rank
        if name == "gemma3":        # the Q4_K_M file's blocks, each rank its part (tests/test_gguf_tp.py)
            assert re.search(r"auto settings: .*quantization gguf", log), log[-3000:]
            assert "weights in their stored format: Q4_K, Q5_0, Q6_K, Q8_0" in log, log[-3000:]
    finally:
        assert srv.terminate() == 0, srv.log()[-3000:]
    assert "rank 1: the leader stopped" in srv.log()


def test_head_count_that_does_not_divide_is_one_startup_error(models, tmp_path):
    srv = ServerProcess(tmp_path / "server.log", "--model", models["qwen3"], "--tensor-parallel-size", "3",
                        "--master-port", str(free_port()), *ENGINE, wait=False)
    try:
        rc = srv.proc.wait(120)
    finally:
        srv.terminate()
    assert rc == 1
    assert re.search(r"the model failed to load: .*ValueError: number of attention heads \(4\) is not divisible "
                     r"by the tensor-parallel size \(3\)", srv.log()), srv.log()[-2000:]
    assert "rendezvous" not in srv.log()


def test_headless_needs_a_follower_node_rank():
    r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--headless", "--tensor-parallel-size", "2"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "bad engine settings: --headless runs a follower node: give it --node-rank > 0" in r.stderr


# ---------------------------------------------------------------- (b) two nodes

class Pair:
    """A leader (node A: HTTP on its own 127.0.0.1) and a headless follower
    (node B), rendezvous at A's address on the veth link."""

    def __init__(self, a, b, model: str, tmp_path, tag: str, *flags: str):
        port = str(free_port())
        common = ["--model", model, "--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", a.addr,
                  "--master-port", port, "--distributed-timeout", "10", *ENGINE, *flags]
        serve = [sys.executable, "-m", "server.cli", "serve"]
        self.leader_log, self.follower_log = tmp_path / f"{tag}-leader.log", tmp_path / f"{tag}-follower.log"
        self.leader = a.popen([*serve, "--host", "127.0.0.1", "--port", "0", "--node-rank", "0", *common],
                              cwd=REPO, env={**os.environ, "GLOO_SOCKET_IFNAME": a.ifname}, stdout=open(self.leader_log, "wb"), stderr=subprocess.STDOUT)
        self.follower = b.popen([*serve, "--headless", "--node-rank", "1", *common], cwd=REPO,
                                env={**os.environ, "GLOO_SOCKET_IFNAME": b.ifname},
                                stdout=open(self.follower_log, "wb"), stderr=subprocess.STDOUT)
        self.a = a
        self.url = self._url()

    def logs(self) -> str:
        return (f"--- leader\n{self.leader_log.read_text(errors='replace')[-3000:]}\n"
                f"--- follower\n{self.follower_log.read_text(errors='replace')[-3000:]}")

    def _url(self) -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", self.leader_log.read_text(errors="replace"))
            if m:
                return m.group(1)
            time.sleep(0.1)
        raise AssertionError(f"the leader did not start:\n{self.logs()}")

    def client(self, prompts, max_tokens: int, *extra: str) -> list[dict]:
        out = self.a.run([*CLIENT, self.url, json.dumps(prompts), str(max_tokens), *extra],
                         capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return parse_client(out.stdout)


def wait_exit(proc, timeout: float) -> tuple[int | None, float]:
    t0 = time.monotonic()
    try:
        return proc.wait(timeout), time.monotonic() - t0
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - t0


@pytest.fixture
def nodes():
    why = netns_unavailable()
    if why:
        print(f"two-node tests skipped: {why}")
        pytest.skip(why)
    with two_nodes() as ab:
        yield ab


def test_two_nodes_over_a_link_match_one_rank(models, references, nodes, tmp_path):
    a, b = nodes
    # Gemma3 over the link passed too (one run, 2026-12-01); CI time keeps it to
    # the one-node test: the link's path does not depend on the model.
    # DeepSeek-V4 runs with --async-scheduling: each step's tokens shared over the link.
    # DeepSeek-V4 with its MTP head: greedy tokens of one rank without drafts.
    for name, flags in [("qwen3", []), ("dsv4", ["--async-scheduling"]), ("dsv4_mtp", MTP)]:
        pair = Pair(a, b, models[name], tmp_path, name, *flags)
        try:
            check_against_reference(name, pair.client(PROMPTS[name], N), references[name])
            log = pair.leader_log.read_text()
            assert ("sampled tokens shared with the other ranks" in log) == (name == "dsv4")
            assert ("speculative decoding: mtp, 2 tokens per step" in log) == (name == "dsv4_mtp")
        finally:
            pair.leader.terminate()
            rc_leader, _ = wait_exit(pair.leader, 60)
            rc_follower, _ = wait_exit(pair.follower, 30)
        assert (rc_leader, rc_follower) == (0, 0), pair.logs()
        assert "rank 1: the leader stopped" in pair.follower_log.read_text()


def test_follower_killed_mid_stream_ends_the_leader(models, nodes, tmp_path):
    a, b = nodes
    pair = Pair(a, b, models["qwen3"], tmp_path, "kill-follower")
    t0 = time.monotonic()
    results = pair.client(token_prompts(2, 5, 20, seed=5), 200, "--kill", str(pair.follower.pid), "--after", "4")
    rc, waited = wait_exit(pair.leader, 30)
    assert rc not in (None, 0), f"leader exit code {rc} after {waited:.1f}s\n{pair.logs()}"
    assert all(r["error"] and "engine core process died" in r["error"] for r in results), results
    assert all(len(r["tokens"]) < 200 for r in results)
    log = pair.leader_log.read_text()
    assert "the engine core is gone: stopping the server" in log, pair.logs()
    print(f"leader exited {rc} {time.monotonic() - t0:.1f}s after the kill; streams: "
          f"{[r['error'][:80] for r in results]}")


def test_leader_killed_ends_the_follower(models, nodes, tmp_path):
    a, b = nodes
    pair = Pair(a, b, models["qwen3"], tmp_path, "kill-leader")
    pair.client(token_prompts(1, 5, 20, seed=6), 4)         # up and serving
    pair.leader.kill()
    rc, waited = wait_exit(pair.follower, 30)
    assert rc not in (None, 0), f"follower exit code {rc} after {waited:.1f}s\n{pair.logs()}"
    assert "rank 1 failed" in pair.follower_log.read_text(), pair.logs()
    print(f"follower exited {rc} {waited:.1f}s after the leader was killed")
