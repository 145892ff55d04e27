"""Run a test function on gloo tensor-parallel ranks, each in a spawned process."""
import os
import tempfile

import torch
import torch.multiprocessing as mp


def _rank(target, rank: int, world: int, init_file: str, out_file: str) -> None:
    import torch.distributed as dist

    from parallel import state
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    state.init_tp()
    try:
        lines = target(rank, world)
    finally:
        dist.destroy_process_group()
        state.reset_tp()
    with open(out_file, "w") as f:
        f.write("\n".join(lines))


def run_ranks(target, world: int = 2, timeout: float = 600) -> list[list[str]]:
    """target(rank, world) -> report lines, a module-level function (spawn
    pickles it by name), run on `world` ranks of one TP group. Returns each
    rank's lines (printed); a rank that raises or hangs fails the test."""
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.txt") for r in range(world)]
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(target, r, world, os.path.join(tmp, "init"), outs[r]))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=timeout)
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
            assert p.exitcode == 0, f"rank {r} failed (exit code {p.exitcode})"
        got = []
        for r in range(world):
            with open(outs[r]) as f:
                got.append(f.read().split("\n"))
            print(f"rank {r}:", got[-1])
        return got
