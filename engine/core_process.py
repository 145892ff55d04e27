"""The engine core in its own process: HTTP stays responsive while the model
computes. Messages in: ("add", EngineRequest) | ("abort", [ids]) |
("call", token, method, args) | ("remove_lora", id) | ("shutdown",).
Messages out: ("ready", ModelInfo) | ("error", text) | ("outputs",
[EngineCoreOutput], EngineStats) | ("reject", id, text, asleep) | ("reply", token,
result, error text or None) | ("dead", text)."""
import ctypes
import logging
import queue
import signal
import sys
import traceback

from engine.engine_args import EngineArgs
from engine.errors import EngineSleeping, InvalidRequest


# EngineCore methods a client may call and wait for (AsyncLLM._call).
CALLS = ("add_lora", "reset_prefix_cache", "sleep", "wake_up", "is_sleeping")


def die_with_parent() -> None:
    """Linux: this process is killed when the process that started it dies,
    even by SIGKILL, so that no engine core or rank outlives its server (its
    tensor-parallel peers then fail at once instead of waiting on it)."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def run_engine_core(args: EngineArgs, in_q, out_q) -> None:
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from engine.engine_core import EngineCore
        core = EngineCore(args, start_local_ranks=False)    # the client started them
    except Exception as e:          # loading failed: tell the client, in one line
        out_q.put(("error", f"{type(e).__name__}: {e}"))
        return
    out_q.put(("ready", core.info))
    core.prepare_grammars()         # off the step loop: the first constrained request does not stall it
    try:
        while True:
            msgs = []
            if not core.has_work():
                try:
                    msgs.append(in_q.get(timeout=1.0))
                except queue.Empty:
                    core.check_alive()      # idle: a lost tensor-parallel rank still ends the engine
                    continue
            while True:
                try:
                    msgs.append(in_q.get_nowait())
                except queue.Empty:
                    break
            changed = False
            for m in msgs:
                if m[0] == "shutdown":
                    core.close()
                    return
                if m[0] == "add":
                    try:
                        core.add_request(m[1])
                    except InvalidRequest as e:
                        out_q.put(("reject", m[1].request_id, str(e), isinstance(e, EngineSleeping)))
                elif m[0] == "abort":
                    core.abort(m[1])
                elif m[0] == "call" and m[2] in CALLS:      # a client call with a reply
                    try:
                        out_q.put(("reply", m[1], getattr(core, m[2])(*m[3]), None))
                    except InvalidRequest as e:
                        out_q.put(("reply", m[1], None, str(e)))
                elif m[0] == "remove_lora":
                    core.remove_lora(m[1])
                changed = True
            outs = core.step() if core.has_work() else []
            if outs or changed:
                out_q.put(("outputs", outs, core.get_stats()))
    except Exception:
        out_q.put(("dead", traceback.format_exc()))
        raise
