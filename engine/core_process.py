"""The engine core in its own process: HTTP stays responsive while the model
computes. Messages in: ("add", EngineRequest) | ("abort", [ids]) |
("shutdown",). Messages out: ("ready", ModelInfo) | ("error", text) |
("outputs", [EngineCoreOutput], EngineStats) | ("reject", id, text) |
("dead", text)."""
import logging
import queue
import traceback

from engine.engine_args import EngineArgs
from engine.errors import InvalidRequest


def run_engine_core(args: EngineArgs, in_q, out_q) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from engine.engine_core import EngineCore
        core = EngineCore(args)
    except Exception as e:          # loading failed: tell the client, in one line
        out_q.put(("error", f"{type(e).__name__}: {e}"))
        return
    out_q.put(("ready", core.info))
    core.prepare_grammars()         # off the step loop: the first constrained request does not stall it
    try:
        while True:
            msgs = []
            if not core.has_work():
                msgs.append(in_q.get())
            while True:
                try:
                    msgs.append(in_q.get_nowait())
                except queue.Empty:
                    break
            changed = False
            for m in msgs:
                if m[0] == "shutdown":
                    return
                if m[0] == "add":
                    try:
                        core.add_request(m[1])
                    except InvalidRequest as e:
                        out_q.put(("reject", m[1].request_id, str(e)))
                elif m[0] == "abort":
                    core.abort(m[1])
                changed = True
            outs = core.step() if core.has_work() else []
            if outs or changed:
                out_q.put(("outputs", outs, core.get_stats()))
    except Exception:
        out_q.put(("dead", traceback.format_exc()))
        raise
