"""`tqserve bench serve` (server/bench.py): a real run against a real server,
its results file, and its answers to bad input."""
import json
import subprocess
import sys
import time
from pathlib import Path

from test_server_process import REPO, SMALL, ServerProcess, free_port

BENCH = [sys.executable, "-m", "server.cli", "bench", "serve"]


def test_bench_serve_help():
    exe = Path(sys.executable).parent / "tqserve"    # the installed entry point, when there is one
    cmd = [str(exe), "bench", "serve", "--help"] if exe.exists() else BENCH + ["--help"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for flag in ("--base-url", "--endpoint", "--num-prompts", "--max-concurrency", "--random-input-len",
                 "--random-output-len", "--dataset-name", "--dataset-path", "--seed", "--result-dir",
                 "--save-result", "--ignore-eos", "--launch-tqserve"):
        assert flag in r.stdout, flag


def test_bench_serve_bad_input_is_one_line_error(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.time()
    r = subprocess.run(BENCH + ["--base-url", url, "--num-prompts", "2", "--result-dir", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert time.time() - t0 < 30
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tqserve bench serve: error: cannot reach"), r.stderr
    assert url in lines[0]
    assert not list(tmp_path.iterdir())              # nothing ran, nothing written

    for args, expect in ((["--dataset-path", str(tmp_path / "missing.txt")], "cannot read --dataset-path"),
                         (["--base-url", "localhost:8000"], "--base-url must look like"),
                         (["--max-concurrency", "0"], "--max-concurrency")):
        r = subprocess.run(BENCH + args, cwd=REPO, capture_output=True, text=True, timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and expect in lines[0], (args, r.stderr)


def test_bench_serve_against_server(tmp_path):
    srv = ServerProcess(tmp_path / "server.log", *SMALL, "--max-num-seqs", "4")
    try:
        t0 = time.time()
        r = subprocess.run(BENCH + ["--base-url", srv.url, "--num-prompts", "6", "--max-concurrency", "2",
                                    "--random-input-len", "32", "--random-output-len", "8", "--ignore-eos",
                                    "--seed", "7", "--tokenizer", "smollm2-135m", "--progress-interval", "5",
                                    "--result-dir", str(tmp_path), "--result-filename", "run"],
                           cwd=REPO, capture_output=True, text=True, timeout=900)
        took = time.time() - t0
        assert r.returncode == 0, f"{r.stdout}\n{r.stderr}\n{srv.log()[-3000:]}"
    finally:
        srv.stop()
    res = json.loads((tmp_path / "run.json").read_text())
    cfg = res["config"]
    assert cfg["num_requests"] == 6 and cfg["concurrency"] == [2] and cfg["prompt_len"] == [32, 32]
    assert cfg["dataset_name"] == "random" and cfg["seed"] == 7 and cfg["tokenizer"] == "smollm2-135m"
    assert res["machine"].startswith(f"{res['machine_info']['cpus']} CPUs, ")
    [target] = res["targets"]
    assert target["model"] == "smollm2-135m"                 # learnt from /v1/models
    [lv] = target["levels"]
    assert lv["concurrency"] == 2 and lv["requests"] == 6
    assert lv["completed"] == 6 and lv["errors"] == 0, lv["error_samples"]
    assert lv["output_tokens"] == 6 * 8
    assert 24 <= lv["prompt_tokens_mean"] <= 40              # the server's count of 32-token prompts
    assert 0 < lv["wall_s"] < took
    assert 0 < lv["ttft_ms_p50"] <= lv["ttft_ms_p99"] < 1000 * took
    assert 0 < lv["tpot_ms_p50"] <= lv["tpot_ms_p99"] < 1000 * took
    assert 0 < lv["itl_ms_p50"] and lv["req_per_s"] > 0 and lv["output_tok_per_s"] > 0
    md = (tmp_path / "run.md").read_text()
    assert "| 2 | 6/0 |" in md and "Machine: " in md
    assert "| 2 | 6/0 |" in r.stdout                       # the table is printed too
