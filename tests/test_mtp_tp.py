"""MTP speculative decoding over two tensor-parallel ranks (DeepSeek-V4,
Qwen3-Next): after each step the leader broadcasts the head's passes
(engine/mtp_proposer.HeadPlan) and every rank runs them, so the head's
sharded attention and MoE all-reduce in step. Runs tests/tp_engine_run.py
(its own process, two ranks, gloo) with shared-prefix prompts and prefix
caching on: the follower's state snapshots wait for the head too.

Checked: greedy tokens equal one rank without drafts or prefix caching;
hits happen; every draft the leader proposed equals the head's over the
whole sequence without a cache, in this process on one rank."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_server_process import free_port
from test_state_prefix_cache import qwen3_next_with_mtp, v4_with_mtp  # noqa: F401 (fixtures)

GREEDY_ROWS = (0, 2, 3)      # tp_engine_run's params: the others sample (drafts change their draws)


def one_rank(path, *flags):
    """tp_engine_run's requests on one rank, in this process."""
    from tp_engine_run import parse, run
    return run(parse([path, "29500", "--shared-prefix", *flags]), ranks=1)      # no group: the port is unused


def run_ranks(path, *flags):
    out = subprocess.run([sys.executable, str(Path(__file__).parent / "tp_engine_run.py"), path, str(free_port()),
                          "--shared-prefix", *flags], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", ["deepseek_v4", "qwen3_next"])
def test_mtp_drafts_over_two_ranks(family, v4_with_mtp, qwen3_next_with_mtp):
    if family == "deepseek_v4":
        from test_spec_decode_mtp import check_drafts

        from engine import LLM
        path, layout = v4_with_mtp, ("--block-size", "2", "--grid", "32")
        model = LLM(path, block_size=2).core.model

        def check(ids, drafts):
            check_drafts(model, ids, drafts)
    else:
        from test_hybrid_mtp import ReferenceMTP
        p, hf, sd = qwen3_next_with_mtp
        path, layout, ref = str(p), (), ReferenceMTP(hf, sd)

        def check(ids, drafts):
            want, margins = ref.drafts(ids, len(drafts))
            n = next((j for j, g in enumerate(margins) if g <= 1e-3), len(drafts))   # near-ties aside
            assert drafts[:n] == want[:n], (len(ids), drafts, want)
    want = one_rank(path, "--no-prefix-caching", *layout)
    got = run_ranks(path, "--mtp", "2", *layout)
    assert [got["outputs"][i] for i in GREEDY_ROWS] == [want["outputs"][i] for i in GREEDY_ROWS]
    assert all(h > 0 for h in got["hits"][2:]) and got["used_blocks"] == 0, got["hits"]
    assert len(got["drafts"]) >= 20
    for ids, drafts in got["drafts"]:
        check(ids, drafts)
