"""The asyncio client of the engine-core process, used by the API server."""
import asyncio
import itertools
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import AsyncIterator

from engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, check_width
from engine.core_process import run_engine_core
from engine.engine_args import EngineArgs
from engine.engine_core import EngineStats, ModelInfo, check_pooling, check_priority, check_request
from engine.errors import EngineDeadError, EngineSleeping, InvalidRequest
from engine.lora import LoRARequest
from engine.multimodal import PromptImages
from engine.output_processor import OutputProcessor, child_params
from engine.outputs import RequestOutput
from engine.pooling_params import PoolingParams
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams, log_sampling_defaults

log = logging.getLogger("tqserve.engine")


class AsyncLLM:
    def __init__(self, args: EngineArgs):
        args.validate()
        self.args = args
        self.model_name = args.model
        self.tokenizer = None
        self.chat_template = None
        self.model_type: str | None = None
        self.default_sampling: dict = {}     # EngineArgs.sampling_defaults: for what a request leaves unset
        self.default_pooling: PoolingParams = PoolingParams()    # EngineArgs.pooling_defaults: embeddings
        self.info: ModelInfo | None = None
        self._stats = EngineStats()
        self._streams: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count()
        self._dead: str | None = None
        self.processor: OutputProcessor | None = None
        self.on_dead = None     # called (in the event loop) once the engine core is gone
        self._closing = False
        self._ranks: list = []
        self._replies: dict[int, asyncio.Future] = {}          # _call()s waiting on the core
        self._beam_searches: dict[str, BeamSearch] = {}         # running beam searches, by request id
        self.images: PromptImages | None = None     # prompts with images (start)

    # -- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        from model_zoo.resolve import open_model
        loop = asyncio.get_running_loop()
        ctx = mp.get_context("spawn")
        self._in, self._out = ctx.Queue(), ctx.Queue()
        self._proc = ctx.Process(target=run_engine_core, args=(self.args, self._in, self._out),
                                 name="tqserve-engine-core", daemon=True)
        self._proc.start()
        # The node's other tensor-parallel ranks: children of this process,
        # since the engine core, a daemon process, may not have any.
        from engine.follower import start_local_ranks
        self._ranks = start_local_ranks(self.args, self.args.topology().node_ranks[1:])
        # The tokenizer and template load here while the core loads weights.
        source = await loop.run_in_executor(None, open_model, self.args.model, self.args.load_format != "dummy",
                                            self.args.tokenizer, self.args.mmproj)
        self.tokenizer, self.chat_template = source.tokenizer, source.chat_template
        self.model_type = source.config.get("model_type")
        self.default_sampling = self.args.sampling_defaults(source)
        self.default_pooling = self.args.pooling_defaults(source)
        log_sampling_defaults(self.default_sampling)
        self.processor = OutputProcessor(self.tokenizer)
        from model_zoo.multimodal import image_processor_for
        self.images = PromptImages(image_processor_for(source.config, source.path), self.tokenizer,
                                   self.args.image_limit(), self.args.max_num_batched_tokens)
        msg = await loop.run_in_executor(None, self._wait_ready)
        if msg[0] != "ready":
            self._proc.join(timeout=5)
            raise RuntimeError(f"engine failed to start: {msg[1]}")
        self.info = msg[1]
        self._loop = loop
        self._reader = threading.Thread(target=self._read, name="tqserve-engine-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self):
        # Poll, so that a core that dies while loading is noticed.
        while True:
            try:
                return self._out.get(timeout=0.5)
            except queue.Empty:
                if not self._proc.is_alive():
                    return ("error", f"engine core exited with code {self._proc.exitcode} while loading")

    async def shutdown(self) -> None:
        if getattr(self, "_proc", None) is None:
            return
        self._closing = True
        if self._proc.is_alive():
            self._in.put(("shutdown",))
            await asyncio.get_running_loop().run_in_executor(None, self._proc.join, 10)
            if self._proc.is_alive():
                self._proc.kill()
        for p in self._ranks:      # they exit when the core stops them, or when it is gone
            await asyncio.get_running_loop().run_in_executor(None, p.join, 10)
            if p.is_alive():
                p.kill()
        self._proc = None

    @property
    def no_images(self) -> str | None:
        """Why image inputs are refused (None: taken)."""
        return self.info.no_images

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def max_logprobs(self) -> int:
        return self.args.max_logprobs

    @property
    def classifier_labels(self) -> list[str] | None:
        return self.info.classifier_labels

    def classifier_pooling(self) -> PoolingParams | None:
        return self.info.classifier_pooling()

    @property
    def kv_info(self) -> dict:
        i = self.info
        return {"capacity_tokens": i.capacity_tokens, "bytes_per_token": i.bytes_per_token,
                "block_size": i.block_size, "bytes_per_token_by_kind": dict(i.bytes_per_token_by_kind),
                "total_bytes": i.kv_total_bytes, "hot_bytes_per_seq": i.hot_bytes_per_seq,
                "compression_ratio": i.compression_ratio, "num_blocks": list(i.num_blocks)}

    def stats(self) -> dict:
        return dict(self._stats.__dict__)

    @property
    def is_alive(self) -> bool:
        return self._dead is None and getattr(self, "_proc", None) is not None and self._proc.is_alive()

    # -- the reader thread ----------------------------------------------------
    def _read(self) -> None:
        proc = self._proc
        while True:
            try:
                msg = self._out.get(timeout=1.0)
            except queue.Empty:
                if self._closing:
                    return
                if proc.is_alive():
                    continue
                msg = ("dead", f"the engine core process exited with code {proc.exitcode}")
            except (EOFError, OSError):
                msg = ("dead", "engine output queue closed")
            self._loop.call_soon_threadsafe(self._dispatch, msg)
            if msg[0] == "dead":
                return

    def _dispatch(self, msg) -> None:
        kind = msg[0]
        if kind == "outputs":
            self._stats = msg[2]
            results, to_abort = self.processor.process(msg[1])
            if to_abort:
                self._in.put(("abort", to_abort))
            for r in results:
                q = self._streams.get(r.request_id)
                if q is not None:
                    q.put_nowait(r)
        elif kind == "reject":
            pid = self.processor.child_to_parent.get(msg[1])
            if pid in self._streams:
                self._in.put(("abort", self.processor.remove(pid)))
                self._streams[pid].put_nowait((EngineSleeping if msg[3] else InvalidRequest)(msg[2]))
        elif kind == "reply":
            fut = self._replies.pop(msg[1], None)
            if fut is not None and not fut.done():
                fut.set_result(msg[2:])
        elif kind == "dead":
            self._dead = msg[1]
            for fut in self._replies.values():
                if not fut.done():
                    fut.set_exception(EngineDeadError("the engine core process died"))
            log.error("engine core died:\n%s", msg[1])
            why = msg[1].strip().splitlines()[-1] if msg[1].strip() else ""
            for q in self._streams.values():
                q.put_nowait(EngineDeadError(f"the engine core process died ({why})"))
            if self.on_dead is not None:
                self.on_dead()

    # -- requests -------------------------------------------------------------
    def encode(self, prompt) -> tuple[str | None, list[int], list]:
        """(text or None, token ids, images: engine.multimodal items) of a
        prompt: text, token ids, or vLLM's dict with multi_modal_data."""
        if isinstance(prompt, dict):
            return self.images.encode_prompt(prompt, self.info.no_images)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer: give prompts as token ids")
            return prompt, self.tokenizer.encode(prompt), []
        return None, list(prompt), []

    def _new_id(self, request_id: str | None, running) -> str:
        """The request's id (a fresh one if None); raises if the engine is dead or the id runs."""
        if self._dead is not None:
            raise EngineDeadError("the engine core process died")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in running:
            raise InvalidRequest(f"request id {rid!r} is already running")
        return rid

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None,
                       priority: int = 0, pooling: PoolingParams | None = None,
                       cache_salt: str | None = None, lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """pooling: an embedding request (params with max_tokens 0): its last
        output's `embedding` is the vector. cache_salt: only requests with the
        same salt share prefix-cache blocks. lora_request: the adapter it
        runs with (enable_lora)."""
        rid = self._new_id(request_id, self._streams)
        text, ids, items = self.encode(prompt)
        check_request(ids, params, self.info.max_model_len, self.info.vocab_size, self.args.max_logprobs)
        check_priority(priority, self.args.scheduling_policy)
        check_pooling(params, pooling, self.info)
        if lora_request is not None and not self.args.enable_lora:
            raise InvalidRequest(f"LoRA adapter {lora_request.lora_name!r} requested, but LoRA is not enabled")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = q
        now = time.monotonic()
        cids = self.processor.add(rid, text, ids, params, now)
        for i, cid in enumerate(cids):
            self._in.put(("add", EngineRequest(cid, ids, child_params(params, i), arrival_time=now,
                                               priority=priority, pooling=pooling, cache_salt=cache_salt,
                                               lora=lora_request, mm_items=items)))
        finished, interval, sent = False, self.args.stream_interval, 0
        try:
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                if interval > 1 and not finished:
                    # stream_interval: outputs are cumulative, so one skipped is sent with the next
                    n = sum(len(o.token_ids) for o in item.outputs)
                    if sent and n - sent < interval:
                        continue
                    sent = n or sent
                yield item
                if finished:
                    break
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self._abort_parent(rid)

    async def add_lora(self, lora: LoRARequest) -> None:
        """Have the core read and check an adapter (InvalidRequest naming what does not fit)."""
        if not self.args.enable_lora:
            raise InvalidRequest("LoRA is not enabled (start the server with --enable-lora)")
        await self._call("add_lora", lora)

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's); False while requests hold KV blocks."""
        return await self._call("reset_prefix_cache")

    async def sleep(self, level: int = 1) -> bool:
        """vLLM's sleep (engine/sleep_mode.py); False while requests hold KV blocks."""
        return await self._call("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call("wake_up", tags)

    async def is_sleeping(self) -> bool:
        return await self._call("is_sleeping")

    async def _call(self, method: str, *args):
        """EngineCore.method(*args) in the core process (core_process.CALLS): its
        result, or InvalidRequest with the core's message."""
        if self._dead is not None:
            raise EngineDeadError("the engine core process died")
        token = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._replies[token] = fut
        self._in.put(("call", token, method, args))
        result, error = await fut
        if error is not None:
            raise InvalidRequest(error)
        return result

    def remove_lora(self, lora_int_id: int) -> None:
        if self._dead is None:
            self._in.put(("remove_lora", lora_int_id))

    def _abort_parent(self, rid: str) -> None:
        ids = self.processor.remove(rid)
        if ids and self._dead is None:
            self._in.put(("abort", ids))

    async def beam_search(self, prompt, params: BeamSearchParams, request_id: str | None = None,
                          priority: int = 0, lora_request: LoRARequest | None = None,
                          cache_salt: str | None = None, skip_special_tokens: bool = True) -> BeamSearchOutput:
        """The best params.beam_width beams (engine/beam_search.py); each
        step's beams run as requests beside any others. abort(request_id)
        ends it with the beams so far (finish_reason "abort")."""
        rid = self._new_id(request_id, self._beam_searches)
        check_width(params, self.args.max_logprobs)
        _, ids, _ = self.encode(prompt)
        check_request(ids, SamplingParams(max_tokens=params.max_tokens), self.info.max_model_len,
                      self.info.vocab_size)     # (the longest beam fits)
        search = self._beam_searches[rid] = BeamSearch(ids, params, set(self.info.eos_token_ids))

        async def final(beam, i):
            out = None
            async for out in self.generate(beam.tokens, search.step_params(), f"{rid}-s{search.steps}-b{i}",
                                           priority, cache_salt=cache_salt, lora_request=lora_request):
                pass
            return out.outputs[0].logprobs
        try:
            while not search.done and not search.aborted:
                lps = await asyncio.gather(*(final(b, i) for i, b in enumerate(search.live)))
                if not search.aborted:
                    search.advance([lp[0] for lp in lps])
            return search.output(self.tokenizer, skip_special_tokens)
        finally:
            del self._beam_searches[rid]

    async def abort(self, request_id: str) -> None:
        """Stop a request; its generate() yields a last output whose
        unfinished choices have finish_reason "abort"."""
        search = self._beam_searches.get(request_id)
        if search is not None:          # its step's beams end; it returns what it has
            search.aborted = True
            for rid in [r for r in self._streams if r.startswith(f"{request_id}-s{search.steps}-b")]:
                await self.abort(rid)
            return
        # (The core is told about the choices that were running: aborted_output
        # used to mark them first, and the core then ran them on to their end.)
        final, running = self.processor.abort(request_id)
        if running and self._dead is None:
            self._in.put(("abort", running))
        q = self._streams.get(request_id)
        if q is not None and final is not None:
            q.put_nowait(final)
