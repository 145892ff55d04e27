"""What the HTTP app knows about its engine and its own settings."""
import asyncio
import logging
import time
from dataclasses import dataclass, field

from server.lora import LoRARegistry
from server.metrics import Metrics
from server.response_store import ResponseStore

log = logging.getLogger("tqserve.server")


@dataclass
class ServerConfig:
    model_names: list[str]                  # served names; the first is reported as `model`
    api_keys: list[str] = field(default_factory=list)
    max_queue: int | None = 256             # waiting requests before a 429; None = unbounded
    max_body_bytes: int = 8 * 1024 * 1024
    max_num_seqs: int = 64                  # the engine's; bounds how many requests run at once
    tool_call_parser: str | None = None     # None: chosen from the model (server.tool_parsers.default_parser)
    reasoning_parser: str | None = None     # None: thinking text stays in content
    responses_store_size: int = 256         # /v1/responses kept for previous_response_id (0: none)
    trust_request_chat_template: bool = False   # a request's own chat_template renders (vLLM's flag)
    return_tokens_as_token_ids: bool = False    # logprobs name tokens "token_id:{id}" (vLLM's flag)
    # CORS, vLLM's flags and defaults: any page may call the API (with the key).
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    request_id_headers: bool = False        # responses carry X-Request-Id (vLLM's --enable-request-id-headers)
    force_include_usage: bool = False       # streams end with usage unasked (vLLM's --enable-force-include-usage)
    response_role: str = "assistant"        # chat's answering role (vLLM's --response-role)
    chat_template_content_format: str = "auto"  # "openai": message content as text parts (vLLM's flag)
    exclude_tools_when_tool_choice_none: bool = False   # (vLLM's flag of that name)
    allowed_local_media_path: str | None = None  # file:// image URLs under it are read (vLLM's flag)


class ServerState:
    """Shared by all handlers: the engine, readiness, counters for overload."""

    def __init__(self, llm, config: ServerConfig):
        self.llm = llm
        self.config = config
        self.ready = False
        self.draining = False
        self.server_load = 0        # POST requests being handled (vLLM's GET /load)
        self.sleeping = False       # the engine was put to sleep (POST /sleep): model routes 503
        self.sleep_level = 0        # its level while it sleeps (tqserve:engine_sleep_state)
        self.load_error: str | None = None
        self.started = time.time()
        self.inflight = 0                   # engine requests submitted and not yet finished
        self._pending: dict[str, float] = {}  # admitted, not yet submitted: id -> time admitted
        self.running_ids: set[str] = set()  # submitted to the engine, not finished
        self.drain_aborted: set[str] = set()  # aborted because a drain ran out of time
        self.stopped_here: set[str] = set()   # ended by a server-side stop rule (llama.cpp's n_indent): "stop"
        self.metrics = self._metrics(8192)
        self._tok_str_cache: dict[int, str] = {}
        self.responses = ResponseStore(config.responses_store_size)
        self.background: dict[str, asyncio.Task] = {}     # /v1/responses running in the background, by id
        self.loras = LoRARegistry()         # LoRA adapters by served name

    # --- engine views (safe while loading) -------------------------------
    def engine_stats(self) -> dict:
        if not self.ready:
            return {}
        try:
            return self.llm.stats() or {}
        except Exception:                   # a scrape must never fail on the engine
            log.exception("engine stats failed")
            return {}

    def engine_alive(self) -> bool:
        return getattr(self.llm, "is_alive", True) is not False

    def kv_info(self) -> dict | None:
        return getattr(self.llm, "kv_info", None) if self.ready else None

    def cache_config(self) -> dict:
        """vLLM's cache_config_info labels, from the engine's settings and its pool."""
        args, info = getattr(self.llm, "args", None), self.kv_info()
        if args is None or not info:
            return {}
        return {"block_size": info.get("block_size"), "cache_dtype": args.kv_cache_dtype,
                "enable_prefix_caching": args.enable_prefix_caching,
                "gpu_memory_utilization": args.gpu_memory_utilization,
                "num_gpu_blocks": sum(info.get("num_blocks") or []), "capacity_tokens": info.get("capacity_tokens")}

    def _metrics(self, max_model_len: int) -> Metrics:
        return Metrics(self.config.model_names[0], max_model_len=max_model_len, stats=self.engine_stats,
                       kv_info=self.kv_info, cache_config=self.cache_config, sleep_level=lambda: self.sleep_level)

    def set_ready(self) -> None:
        """Called once the engine is up; fixes values that depend on the model."""
        self.metrics = self._metrics(self.llm.max_model_len)
        self.ready = True

    @property
    def tool_call_parser(self) -> str:
        if self.config.tool_call_parser:
            return self.config.tool_call_parser
        from server.tool_parsers import default_parser
        return default_parser(getattr(self.llm, "model_type", None), getattr(self.llm, "chat_template", None)) \
            or "hermes"

    @property
    def model_name(self) -> str:
        return self.config.model_names[0]

    def queue_depth(self) -> int:
        """Requests waiting for a slot: what the server has submitted beyond what the
        engine can run at once. The engine's own waiting count is no measure (a burst
        waits there for the next step even with slots free, and it lags); it only
        tells when the KV cache, not max_num_seqs, is what bounds the running set."""
        s = self.engine_stats()
        slots = self.config.max_num_seqs
        if s.get("num_waiting", 0) > 0 and s.get("kv_cache_usage", 0.0) >= 0.9:
            slots = min(slots, int(s.get("num_running", slots)))
        self._prune_pending()
        return self.inflight + len(self._pending) - slots

    def _prune_pending(self) -> None:
        now = time.monotonic()
        for rid in [r for r, t in self._pending.items() if now - t > 2.0]:
            del self._pending[rid]          # admitted but never submitted (client left early)

    def reserve(self, request_ids: list[str]) -> None:
        now = time.monotonic()
        for rid in request_ids:
            self._pending[rid] = now

    def start_request(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self.running_ids.add(request_id)
        self.inflight += 1

    def end_request(self, request_id: str) -> None:
        self.running_ids.discard(request_id)
        self.drain_aborted.discard(request_id)
        self.inflight -= 1

    # --- draining ----------------------------------------------------------
    def draining_message(self) -> str:
        """What /health says while draining."""
        n = len(self.running_ids)
        return f"The server is draining: {n} request(s) in flight; no new requests are accepted."

    async def drain(self, timeout: float) -> None:
        """Stop admitting (`draining`), wait until what runs has finished, and after
        `timeout` seconds abort what is still running: its responses end with
        finish_reason "abort" (streams get their final chunk and [DONE]). Requests
        admitted just before (not yet submitted to the engine) are waited for too."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._prune_pending()
            if not self.running_ids and not self._pending:
                break
            await asyncio.sleep(0.05)
        if self.running_ids:
            log.info("drain: aborting %d request(s) still running after %.0fs", len(self.running_ids), timeout)
        for rid in list(self.running_ids):
            self.drain_aborted.add(rid)
            try:
                await self.llm.abort(rid)
            except Exception:
                log.exception("abort %s failed", rid)

    # --- tokens ------------------------------------------------------------
    def tok_str(self, token_id: int) -> str:
        s = self._tok_str_cache.get(token_id)
        if s is None:
            tok = self.llm.tokenizer
            if tok is None:
                s = f"token_id:{token_id}"
            else:
                try:
                    s = tok.decode([token_id], skip_special_tokens=False)
                except Exception:
                    s = f"token_id:{token_id}"
            self._tok_str_cache[token_id] = s
        return s
