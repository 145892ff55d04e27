"""`tqserve` command line: `tqserve serve --model NAME_OR_PATH ...`.

The HTTP socket is bound first (so /health answers 503 while the model loads
and a bad port fails before any loading), then the engine starts. SIGTERM or
Ctrl-C drains: the socket stays open, /health and new generation requests get
503, in-flight ones finish within --drain-timeout seconds or are aborted
(finish_reason "abort"); then the socket closes and the process exits 0. A
second SIGTERM or Ctrl-C during the drain aborts what runs and exits at once.
"""
import argparse
import asyncio
import contextlib
import dataclasses
import logging
import logging.config
import os
import socket
import sys
import typing
from pathlib import Path

log = logging.getLogger("tqserve")

ENV_API_KEY = "TQSERVE_API_KEY"


def parse_bytes_or_fraction(s: str) -> int | float:
    """'0.3' -> 0.3 (fraction of free memory); '2000000', '512MiB', '2G', '1.5GB' -> bytes."""
    from engine.engine_args import parse_memory
    return _cli_type(parse_memory)(s)


def _cli_type(parse):
    """argparse shows an ArgumentTypeError's own message (a ValueError's it hides)."""
    def run(s: str):
        try:
            return parse(s)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    run.__name__ = parse.__name__
    return run


def json_list(s: str) -> list[str]:
    """A JSON list of strings given on the command line ('["http://a.example"]')."""
    import json
    try:
        v = json.loads(s)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e}): {s!r}") from None
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError(f"expected a JSON list of strings, got {s!r}")
    return v


def engine_fields():
    """The EngineArgs fields that are command-line flags (those with help)."""
    from engine.engine_args import EngineArgs
    return [f for f in dataclasses.fields(EngineArgs) if "help" in f.metadata]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One --flag-name per engine field: engine/engine_args.py holds each default and help."""
    for f in engine_fields():
        kw = dict(f.metadata)
        base = next((t for t in typing.get_args(f.type) if t is not type(None)), f.type)
        if base is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _cli_type(kw.get("type", base))
        p.add_argument("--" + f.name.replace("_", "-"), default=f.default, **kw)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tqserve", description="OpenAI-compatible LLM server.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("model_tag", nargs="?", help="same as --model")
    s.add_argument("--model", default=None,
                   help="model name (smollm2-135m, gemma3-270m), HF directory or .gguf path "
                        "[default: smollm2-135m]")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0 picks a free port (the startup line shows it)")
    s.add_argument("--api-key", nargs="+", action="extend", default=None,
                   help=f"accepted API key(s) for /v1 routes; also ${ENV_API_KEY}")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use as `model`; the first is reported")
    add_engine_args(s)
    s.add_argument("--kv-cache-memory-bytes", dest="kv_cache_memory", type=parse_bytes_or_fraction,
                   default=argparse.SUPPRESS, help="vLLM's name of --kv-cache-memory")
    s.add_argument("--config", default=None,
                   help="a YAML file of flags ({flag-name: value}, vLLM's); flags given here win")
    s.add_argument("--max-queue", type=int, default=256,
                   help="waiting requests before new ones get 429 (0 = unbounded)")
    s.add_argument("--max-request-bytes", type=parse_bytes_or_fraction, default=8 << 20,
                   help="largest request body; larger gets 413")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    # Longer than the clients' own idle-connection expiry (httpx 5 s, aiohttp 15 s): with
    # uvicorn's 5 s a pooled connection can be closed by the server just as the client
    # reuses it, and the request fails with "Server disconnected without sending a response".
    s.add_argument("--timeout-keep-alive", type=int, default=30,
                   help="seconds an idle HTTP keep-alive connection stays open")
    s.add_argument("--headless", action="store_true",
                   help="a follower node of a multi-node tensor-parallel group (--node-rank > 0): run this "
                        "node's ranks only, no HTTP; exits when the leader stops")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    # vLLM's logging and HTTP flags, honoured.
    s.add_argument("--uvicorn-log-level", default=None,
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own log level [default: --log-level]")
    s.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per request (vLLM's flag)")
    s.add_argument("--disable-log-stats", action="store_true",
                   help="no throughput / queue / KV cache line every 10 s while serving (vLLM's flag)")
    s.add_argument("--log-config-file", default=None,
                   help="a JSON logging configuration (logging.config.dictConfig) applied at start")
    s.add_argument("--uds", default=None, help="listen on this Unix domain socket instead of --host / --port")
    s.add_argument("--enable-request-id-headers", action="store_true",
                   help="responses carry X-Request-Id (the request's own, else a new one)")
    s.add_argument("--enable-force-include-usage", action="store_true",
                   help="streams end with a usage chunk even without stream_options.include_usage")
    s.add_argument("--response-role", default="assistant",
                   help="the role chat completions answer with")
    s.add_argument("--chat-template-content-format", default="auto", choices=["auto", "string", "openai"],
                   help="message content as the template gets it: a string (auto, string) or a list of "
                        "{\"type\": \"text\", \"text\": ...} parts (openai)")
    s.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="a request with tool_choice \"none\" renders its prompt without the tools")
    s.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="file:// image URLs are read under this directory (vLLM's flag; default: none are)")
    s.add_argument("--h11-max-incomplete-event-size", type=int, default=None,
                   help="the largest HTTP request head (bytes) uvicorn reads [default: uvicorn's]")
    from server.reasoning_parsers import PARSERS as reasoning_parsers
    from server.tool_parsers import ALIASES as tool_aliases, PARSERS as tool_parsers
    s.add_argument("--tool-call-parser", default=None, choices=sorted([*tool_parsers, *tool_aliases]),
                   help="how tool calls are written in the model's output [default: chosen from the "
                        "model's type and chat template, else hermes]")
    # vLLM command lines carry these; here tool calls are always parsed (tool_choice
    # "auto" needs no switch) and no code from a checkpoint ever runs.
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM command lines: tool calls are always parsed")
    s.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM command lines: tqserve runs no code from the model's files")
    s.add_argument("--chat-template", default=None,
                   help="a jinja chat template, as a file path or the template itself, used instead of the "
                        "model's (vLLM's flag; DeepSeek-V4 ships none)")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat_template given in a request (vLLM's flag; off: such requests get a 400)")
    s.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name each token \"token_id:{id}\" instead of its text (vLLM's flag; a "
                        "request's return_tokens_as_token_ids overrides it)")
    s.add_argument("--reasoning-parser", default=None, choices=sorted(reasoning_parsers),
                   help="split <think>...</think> text into reasoning_content [default: off]")
    from server.state import ServerConfig
    s.add_argument("--responses-store-size", type=int, default=ServerConfig.responses_store_size,
                   help="finished /v1/responses kept in memory for previous_response_id and GET "
                        "(least recently used out first; 0: none)")
    # vLLM's CORS flags (JSON lists); defaults in ServerConfig: any origin.
    for flag, what in (("origins", "origins a browser page may call the API from"),
                       ("methods", "HTTP methods"), ("headers", "request headers")):
        s.add_argument(f"--allowed-{flag}", type=_cli_type(json_list), default=None,
                       help=f'CORS: {what}, a JSON list such as \'["*"]\' [default: any]')
    s.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)")
    s.add_argument("--ssl-keyfile", default=None, help="TLS: the private key (PEM) of --ssl-certfile, if not in it")
    s.add_argument("--ssl-certfile", default=None, help="TLS: serve HTTPS with this certificate chain (PEM)")
    s.add_argument("--ssl-ca-certs", default=None, help="TLS: CA certificates that client certificates must "
                                                        "chain to (with --ssl-cert-reqs)")
    s.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                   help="TLS: client certificates: 0 not asked, 1 optional, 2 required (Python's ssl.CERT_*)")
    s.add_argument("--root-path", default="", help="the path prefix a reverse proxy serves the API under")
    s.add_argument("--lora-modules", nargs="+", action="extend", default=None,
                   help="LoRA adapters (PEFT directories) served by name, with --enable-lora: name=path or "
                        '\'{"name": "sql", "path": "/adapters/sql", "base_model_name": "..."}\'; a request\'s '
                        "`model` picks one")
    from server import vllm_flags
    vllm_flags.add_flags(s)
    from server import plan
    plan.add_parser(sub)
    from server import bench
    bench.add_parser(sub)
    from server import run_batch
    run_batch.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        from server.vllm_flags import expand_config
        try:
            argv = ["serve"] + expand_config(argv[1:], _switches(parser))
        except ValueError as e:
            parser.error(str(e))
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "plan":
        from server import plan
        return plan.run(args)
    if args.command == "bench":
        from server import bench
        return bench.run(args)
    if args.command == "run-batch":
        from server import run_batch
        return run_batch.run(args)
    return 2


# --------------------------------------------------------------------------
def tool_aliases_of(name: str | None) -> str | None:
    """--tool-call-parser: vLLM's other names (llama4_json, ...) as this server's."""
    from server.tool_parsers import ALIASES
    return ALIASES.get(name, name)


def _switches(parser: argparse.ArgumentParser):
    """flag -> "both" (--flag / --no-flag), "on" (--flag only) or None (takes a value), for `serve`."""
    serve_parser = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices["serve"]
    actions = serve_parser._option_string_actions

    def kind(flag: str) -> str | None:
        a = actions.get(flag)
        if isinstance(a, argparse.BooleanOptionalAction):
            return "both"
        if isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return "on"
        return None
    return kind


def serve(args) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_config_file:
        import json
        try:
            with open(args.log_config_file) as f:
                logging.config.dictConfig(json.load(f))
        except (OSError, ValueError, TypeError) as e:
            log.error("--log-config-file %s: %s", args.log_config_file, e)
            return 2
    if args.disable_log_requests:
        logging.getLogger("tqserve.request").setLevel(logging.WARNING)
    from server import vllm_flags
    reason = vllm_flags.refused(args)
    if reason:
        log.error("%s", reason)
        return 2
    model = args.model or args.model_tag or "smollm2-135m"
    if args.headless:
        return _serve_headless(args, model)
    if (args.ssl_keyfile or args.ssl_ca_certs or args.ssl_cert_reqs) and not args.ssl_certfile:
        log.error("--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile")
        return 2
    keys = list(args.api_key or [])
    if os.environ.get(ENV_API_KEY):
        keys.append(os.environ[ENV_API_KEY])
    try:
        sock = _bind_unix(args.uds) if args.uds else _bind(args.host, args.port)
    except OSError as e:
        log.error("cannot listen on %s: %s", args.uds or f"{args.host}:{args.port}", e)
        return 1
    scheme = "https" if args.ssl_certfile else "http"
    if args.uds:
        url = f"{scheme}+unix://{args.uds}"
    else:
        host = sock.getsockname()[0]
        url = f"{scheme}://{'[' + host + ']' if ':' in host else host}:{sock.getsockname()[1]}"
    log.info("listening on %s; loading %s (/health is 503 until it is ready)", url, model)

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        rc, clean = loop.run_until_complete(_serve(args, model, keys, sock, url))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()
    if not clean:
        # The engine was stopped mid-load; a worker thread may still wait on it.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def _serve_headless(args, model: str) -> int:
    from engine import EngineArgs
    from engine.follower import run_headless
    try:
        engine_args = EngineArgs(model=model, **{f.name: getattr(args, f.name) for f in engine_fields()})
        engine_args.validate()
        if engine_args.node_rank == 0:
            raise ValueError("--headless runs a follower node: give it --node-rank > 0 (node 0 serves HTTP)")
    except ValueError as e:
        log.error("bad engine settings: %s", e)
        return 2
    return run_headless(engine_args)


def chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, else the value itself (vLLM's rule); it
    must compile (ValueError: one line at startup, not an error per request)."""
    if not value:
        return None
    from model_zoo.chat_template import compile_template
    path = Path(value).expanduser()
    text = path.read_text(encoding="utf-8") if path.is_file() else value
    if not path.is_file() and not any(m in value for m in ("{{", "{%")):
        raise ValueError(f"--chat-template {value!r} is neither a file nor a jinja template")
    try:
        compile_template(text)
    except Exception as e:
        raise ValueError(f"--chat-template does not compile: {str(e).splitlines()[0]}") from None
    return text


def _bind_unix(path: str) -> socket.socket:
    """--uds: a Unix domain socket at path (a stale socket file there is replaced)."""
    import stat
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def _serve(args, model: str, keys: list[str], sock: socket.socket, url: str) -> tuple[int, bool]:
    import uvicorn

    from engine import AsyncLLM, EngineArgs
    from server.app import create_app
    from server.lora import parse_lora_module
    from server.state import ServerConfig, ServerState

    try:
        engine_args = EngineArgs(model=model, **{f.name: getattr(args, f.name) for f in engine_fields()})
        template = chat_template(args.chat_template)
        if args.lora_modules and not engine_args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        lora_modules = [parse_lora_module(m) for m in args.lora_modules or []]
        taken = [n for n, _, _ in lora_modules] + list(args.served_model_name or [model])
        if len(set(taken)) < len(taken):
            raise ValueError(f"--lora-modules: each adapter needs a name of its own, not a served model's or "
                             f"another adapter's (got {', '.join(taken)})")
        llm = AsyncLLM(engine_args)
    except ValueError as e:
        log.error("bad engine settings: %s", e)
        return 2, True
    names = args.served_model_name or [model]
    state = ServerState(llm, ServerConfig(model_names=names, api_keys=keys,
                                          max_queue=args.max_queue or None,
                                          max_body_bytes=int(args.max_request_bytes),
                                          max_num_seqs=args.max_num_seqs,
                                          tool_call_parser=tool_aliases_of(args.tool_call_parser),
                                          reasoning_parser=args.reasoning_parser,
                                          responses_store_size=max(0, args.responses_store_size),
                                          trust_request_chat_template=args.trust_request_chat_template,
                                          return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                                          allow_credentials=args.allow_credentials,
                                          request_id_headers=args.enable_request_id_headers,
                                          force_include_usage=args.enable_force_include_usage,
                                          response_role=args.response_role,
                                          chat_template_content_format=args.chat_template_content_format,
                                          exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
                                          allowed_local_media_path=args.allowed_local_media_path,
                                          **{f"allowed_{k}": getattr(args, f"allowed_{k}")
                                             for k in ("origins", "methods", "headers")
                                             if getattr(args, f"allowed_{k}") is not None}))
    # uvicorn's shutdown starts once state.drain is done (see _server_class), so its
    # grace period is only a backstop for the last chunks of responses that just
    # ended (finish_reason "abort" and [DONE] after --drain-timeout).
    h11 = {"h11_max_incomplete_event_size": args.h11_max_incomplete_event_size} \
        if args.h11_max_incomplete_event_size else {}
    config = uvicorn.Config(create_app(state), lifespan="off", access_log=False, log_config=None,
                            log_level=args.uvicorn_log_level or args.log_level, timeout_graceful_shutdown=5, **h11,
                            timeout_keep_alive=args.timeout_keep_alive, root_path=args.root_path,
                            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                            ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs)
    try:
        config.load()       # (reads the TLS files: a bad one fails here, before the model loads)
    except OSError as e:
        log.error("cannot use the TLS certificate or key: %s", e)
        return 2, True
    server = _Server(config, state, args.drain_timeout)
    died = []

    def on_dead():
        # Nothing can be served without the engine: the in-flight requests got
        # their error (503) just now; the server stops, non-zero, so that its
        # supervisor (systemd, docker) restarts it.
        log.error("the engine core is gone: stopping the server")
        died.append(True)
        asyncio.get_running_loop().call_later(0.5, setattr, server, "should_exit", True)
    llm.on_dead = on_dead
    serve_task = asyncio.create_task(server.serve(sockets=[sock]))
    load_task = asyncio.create_task(_start(llm, state, lora_modules))
    await asyncio.wait({serve_task, load_task}, return_when=asyncio.FIRST_COMPLETED)
    rc, clean = 0, True
    if load_task.done():
        exc = load_task.exception()
        if exc is not None:
            state.load_error = f"{type(exc).__name__}: {exc}"
            log.error("the model failed to load: %s", state.load_error)
            server.should_exit = True
            rc = 1
        else:
            if template is not None:
                llm.chat_template = template
            state.set_ready()
            if not args.disable_log_stats:
                from server.stats_log import StatsLogger
                server._spawn(StatsLogger(state).run())
            kv = llm.kv_info or {}
            log.info("ready: model %s (served as %s) | context %d tokens | KV cache %d tokens, %s bytes/token"
                     " | %s", model, ", ".join(names), llm.max_model_len, kv.get("capacity_tokens", 0),
                     _fmt(kv.get("bytes_per_token", 0)), url)
        await serve_task
        for t in list(server._tasks):
            t.cancel()
        if died:
            rc = 1
    else:
        log.info("stopped while loading")
        load_task.cancel()
        with contextlib.suppress(BaseException):
            await load_task
        clean = False
    with contextlib.suppress(Exception):
        await asyncio.wait_for(llm.shutdown(), timeout=30)
    log.info("stopped")
    return rc, clean


async def _start(llm, state, lora_modules) -> None:
    """The engine, then the --lora-modules adapters (read and checked by it)."""
    await llm.start()
    for name, path, parent in lora_modules:
        lora = state.loras.new(name, path)
        await llm.add_lora(lora)
        state.loras.register(lora, parent)
        log.info("LoRA adapter %s: %s", name, lora.lora_path)


def _fmt(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, with draining. The first SIGTERM/SIGINT does not stop uvicorn:
        the listener stays up, the app is marked draining (/health and new
        generation requests answer 503 in OpenAI's shape) and ServerState.drain
        waits for the in-flight requests, aborting what still runs after the drain
        timeout (those responses end with finish_reason "abort" and [DONE]). Only
        then is uvicorn told to exit (should_exit): it stops accepting, closes idle
        keep-alive connections and lets the last responses finish. A second
        SIGTERM/SIGINT during the drain stops at once: what runs is aborted and
        uvicorn exits without waiting for connections (force_exit). Either way the
        exit is a clean one, code 0 (uvicorn would re-raise the signal and die by it)."""

        def __init__(self, config, state, drain_timeout):
            super().__init__(config)
            self.tq_state = state
            self.drain_timeout = drain_timeout
            self.loop = None
            self._tasks = set()
            self._signalled = False

        async def serve(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets=sockets)

        def handle_exit(self, sig, frame):
            # Runs in the main thread (uvicorn installs it with signal.signal), between
            # two bytecodes of whatever runs there: only flag and schedule here.
            # super().handle_exit is not called: it would stop the listener at once.
            state, loop = self.tq_state, self.loop
            state.draining = True
            if loop is None or loop.is_closed():
                self.should_exit = True
                return
            if not self._signalled:
                self._signalled = True
                log.info("signal %s: draining (in-flight requests get %gs; /health answers 503)",
                         sig, self.drain_timeout)
                loop.call_soon_threadsafe(self._spawn, self._drain_then_exit())
            else:
                log.info("signal %s again: stopping now, aborting %d request(s)", sig, len(state.running_ids))
                loop.call_soon_threadsafe(self._spawn, self._stop_now())

        def _spawn(self, coro):
            task = asyncio.get_running_loop().create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        async def _drain_then_exit(self):
            try:
                await self.tq_state.drain(self.drain_timeout)
                log.info("drained; closing the listener")
            except Exception:
                log.exception("drain failed")
            finally:
                self.should_exit = True

        async def _stop_now(self):
            for t in list(self._tasks):
                if t is not asyncio.current_task():
                    t.cancel()
            try:
                await asyncio.wait_for(self.tq_state.drain(0), timeout=5)
            except Exception:
                log.exception("abort on a second signal failed")
            finally:
                self.force_exit = True
                self.should_exit = True

    return Server


def _Server(config, state, drain_timeout):
    return _server_class()(config, state, drain_timeout)


if __name__ == "__main__":
    sys.exit(main())
