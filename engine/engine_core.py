"""The engine core: scheduler + KV pool + model runner, stepped in a loop.

It runs either in the caller's process (offline LLM, tests) or in its own
process behind the async client (core_process.py)."""
import logging
import os
import threading
import time
from dataclasses import dataclass, field


from engine import prefix_store
from engine.bad_words import token_sequences
from engine.engine_args import EngineArgs
from engine.errors import EngineSleeping, InvalidRequest
from engine.follower import Followers, Sleep, WakeUp
from engine.lora import LoRAManager, LoRARequest
from engine.model_runner import ModelRunner
from engine.multimodal import check_items
from engine.pooling_params import PoolingParams
from engine.request import EngineRequest, Request, Status
from engine.scheduler import Scheduler
from engine.speculative import make_proposer
from engine.structured_output import GrammarCompiler, GrammarState, StructuredOutputError
from engine.worker import Worker
from kvcache.kv_manager import KVCacheManager
from kvcache.pool_plan import cache_objects
from model_zoo.models import classifier_labels, has_score_head
from model_zoo.multimodal import image_processor_for

log = logging.getLogger("tqserve.engine")


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict] | None = None
    prompt_logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stopped_on_token: bool = False      # the last new token is the eos / stop token (not shown as text)
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    embedding: list[float] | None = None    # a pooling request's vector (with its finish)
    prediction: tuple[int, int] | None = None   # (accepted, rejected) predicted-output drafts (with its finish)


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    steps_total: int = 0
    # Speculative decoding (vLLM's spec_decode_* counters).
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # LoRA (vLLM's lora_requests_info): None without --enable-lora.
    max_lora: int | None = None
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)


@dataclass
class ModelInfo:
    """What a client needs to know about the loaded engine."""
    max_model_len: int
    eos_token_ids: list[int]
    capacity_tokens: int
    bytes_per_token: int
    bytes_per_token_by_kind: dict
    block_size: int
    num_blocks: list[int]
    kv_total_bytes: int
    vocab_size: int
    hidden_size: int = 0              # the final hidden states' width (what embeddings pool)
    generates: bool = True            # False: no language-model head (an embedding checkpoint)
    hot_bytes_per_seq: int = 0        # TurboQuant hot tokens a running sequence holds
    compression_ratio: float = 1.0    # 16-bit KV bytes per token / stored bytes per token
    # A classifier: its labels, and a token classifier's tokens (--hf-overrides
    # classifier_from_token) or None for a score head (a ForSequenceClassification checkpoint).
    classifier_labels: list[str] | None = None
    classifier_token_ids: list[int] | None = None
    no_images: str | None = "this model takes no images (text only)"   # why image inputs are refused; None: taken

    def classifier_pooling(self) -> PoolingParams | None:
        """How a request runs the classifier (None: the model is none)."""
        if self.classifier_labels is None:
            return None
        ids = self.classifier_token_ids
        return PoolingParams("last", normalize=False, classify_token_ids=tuple(ids) if ids is not None else None,
                             score_head=ids is None)


def check_priority(priority: int, policy: str) -> None:
    """Raise InvalidRequest for a priority the scheduling policy ignores (as vLLM)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidRequest(f"priority must be an integer, got {priority!r}")
    if priority and policy != "priority":
        raise InvalidRequest(f"priority {priority} needs --scheduling-policy priority (this server's is {policy})")


def check_request(prompt_token_ids: list[int], params, max_model_len: int, vocab_size: int,
                  max_logprobs: int = 20) -> None:
    """Raise InvalidRequest for a request that can never run."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequest("the prompt is empty")
    # A prompt may fill the context only when nothing is generated (scoring).
    if n > max_model_len or (n == max_model_len and params.max_tokens != 0):
        raise InvalidRequest(f"this model's maximum context length is {max_model_len} tokens, "
                             f"but the prompt has {n} tokens (no room for output)")
    mt = params.max_tokens
    if mt is not None and n + mt > max_model_len:
        raise InvalidRequest(f"this model's maximum context length is {max_model_len} tokens; "
                             f"the prompt has {n} tokens and max_tokens is {mt}, {n + mt} in total")
    if vocab_size and (min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size):
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})")
    if vocab_size and params.allowed_token_ids is not None and max(params.allowed_token_ids) >= vocab_size:
        raise InvalidRequest(f"allowed_token_ids must be in [0, {vocab_size})")
    if max_logprobs >= 0:
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > max_logprobs:
                raise InvalidRequest(f"requested {name} of {k}, which is greater than max allowed: {max_logprobs} "
                                     f"(--max-logprobs)")


def check_pooling(params, pooling, info: ModelInfo) -> None:
    """Raise InvalidRequest for an embedding request (pooling: PoolingParams)
    that cannot run, or a generation request (None) to a model that only embeds."""
    if pooling is None:
        if not info.generates:
            raise InvalidRequest("this model has no language-model head (an embedding checkpoint): it serves "
                                 "embeddings only")
        return
    if params.max_tokens != 0 or params.n != 1:
        raise InvalidRequest("an embedding request generates nothing: give it max_tokens 0 and n 1")
    if pooling.dimensions is not None and info.hidden_size and pooling.dimensions > info.hidden_size:
        raise InvalidRequest(f"dimensions must be at most the model's {info.hidden_size}, got {pooling.dimensions}")
    if pooling.score_head and (info.classifier_labels is None or info.classifier_token_ids is not None):
        raise InvalidRequest("this model has no score head (a ForSequenceClassification checkpoint's)")
    ids = pooling.classify_token_ids
    if ids is not None and (not info.generates or not all(0 <= t < info.vocab_size for t in ids)):
        raise InvalidRequest("a token classifier needs the model's language-model head and token ids in its "
                             "vocabulary")


class EngineCore(Worker):
    """Rank 0: the Worker's phases (join the ranks, load the model, set up
    the KV caches), then the KV manager, scheduler and runner."""

    def __init__(self, args: EngineArgs, source=None, start_local_ranks: bool = True):
        super().__init__(args, source, rank=0, start_local_ranks=start_local_ranks)
        args = self.args
        self._init_scheduler(self.caches)
        self._init_prefix_store()
        self._init_speculation()
        if not self.source.generates:
            log.warning("%s has no language-model head (an embedding checkpoint): embedding requests only",
                        args.model)
        per_seq = "".join(f" + {b} B/sequence of {what}" for b, what in (
            (self.plan.state_bytes_per_seq, "fixed state"), (self.plan.hot_bytes_per_seq, "hot tokens")) if b)
        log.info("engine ready in %.1fs: %s on %s%s, max_model_len %d, KV %d tokens x %s B/token (%s)%s, "
                 "%.1f MiB", time.monotonic() - self.t0, args.model, self.device,
                 f" x {self.tp} tensor-parallel ranks" if self.tp > 1 else "", self.max_model_len, self.plan.capacity_tokens,
                 f"{self.plan.bytes_per_token:g}", self.plan.bytes_per_token_by_kind(), per_seq,
                 self.plan.total_bytes / 2**20)

    # -- startup phases (after the Worker's) -----------------------------------
    def _init_scheduler(self, caches) -> None:
        args = self.args
        plan = self.plan
        caching = args.enable_prefix_caching and plan.prefix_caching
        if args.enable_prefix_caching and not caching:
            log.info("prefix caching off: this model's cache holds per-sequence state (DeepSeek-V4's sliding "
                     "ring and compressor carry, linear-attention layers' recurrent state) and the KV budget "
                     "leaves no room for snapshots of it")
        elif plan.num_snapshots:
            log.info("prefix caching: per-sequence state kept every %d tokens in up to %d snapshots (%.1f MiB); "
                     "hits resume there", plan.snapshot_interval, plan.num_snapshots, plan.snapshot_bytes / 2**20)
        self.kv = KVCacheManager(plan.groups, plan.num_blocks, args.block_size, caching,
                                 max_rollback=plan.max_rollback, num_snapshots=plan.num_snapshots,
                                 snapshot_interval=plan.snapshot_interval, lookahead=int(self.mtp_drafts))
        self.loras = LoRAManager(self.lora) if self.lora is not None else None
        self.scheduler = Scheduler(self.kv, args.max_num_seqs, args.max_num_batched_tokens,
                                   args.long_prefill_token_threshold, args.scheduling_policy, self.loras)
        self.runner = ModelRunner(self.model, self.kv, caches,
                                  followers=Followers(self.args.distributed_timeout, self.device)
                                  if self.tp > 1 else None,
                                  graphs=self.graphs, head_graphs=self.head_graphs,
                                  lora=self.lora, lora_manager=self.loras)
        self._grammars: GrammarCompiler | None = None    # at prepare_grammars or the first constrained request
        self.stats = EngineStats()
        self.info = ModelInfo(
            max_model_len=self.max_model_len, eos_token_ids=list(self.source.eos_token_ids),
            capacity_tokens=self.plan.capacity_tokens, bytes_per_token=self.plan.bytes_per_token,
            bytes_per_token_by_kind=self.plan.bytes_per_token_by_kind(), block_size=args.block_size,
            num_blocks=list(self.plan.num_blocks), kv_total_bytes=self.plan.total_bytes,
            vocab_size=int(self.source.config.get("vocab_size", 0)),
            hidden_size=int(self.source.config.get("hidden_size", 0)),
            generates=self.source.generates,
            hot_bytes_per_seq=self.plan.hot_bytes_per_seq, compression_ratio=self.plan.compression_ratio)
        self.info.classifier_labels, self.info.classifier_token_ids = self._classifier()
        self.info.no_images = self._no_images(caches)

    def _no_images(self, caches) -> str | None:
        """Why this engine refuses images (None: it takes them): a text-only
        model, or an attention backend that cannot run an image's
        bidirectional span."""
        images = image_processor_for(self.source.config)
        if images is None:
            return ModelInfo.no_images
        if images.bidirectional:
            why = next(filter(None, (c.no_key_limits for c in cache_objects(caches))), None)
            if why:
                log.warning("image inputs are refused: %s", why)
                return f"images are not supported with this KV cache: {why}"
        log.info("image inputs: %d tokens per image%s, --limit-mm-per-prompt %s", images.tokens_per_image,
                 " (attending to each other)" if images.bidirectional else "",
                 self.args.image_limit() if self.args.image_limit() is not None else "none")
        return None

    def _init_prefix_store(self) -> None:
        """prefix_cache_file (engine/prefix_store.py): the saved prefix cache read into the pool."""
        path = self.args.prefix_cache_file
        if not path:
            return
        why = prefix_store.unsupported(self.caches, self.plan.groups, self.tp) or (
            None if self.kv.enable_caching else "prefix caching is off")
        if why:
            raise ValueError(f"prefix_cache_file: the prefix cache cannot be kept in a file: {why}")
        self.kv.remember_tokens = True
        self._prefix_stamp = prefix_store.fingerprint(self.caches, self.source.config, self.args.block_size,
                                                      self.args.kv_cache_dtype)
        if os.path.exists(path):
            t0 = time.monotonic()
            n = prefix_store.load(path, self.kv, self.caches, self._prefix_stamp)
            log.info("prefix cache: %d blocks read from %s in %.2fs", n, path, time.monotonic() - t0)

    def save_prefix_cache(self) -> None:
        """Write the prefix cache to prefix_cache_file (at close; not while asleep: it was reset)."""
        path = self.args.prefix_cache_file
        if not path or self.asleep is not None:
            return
        t0 = time.monotonic()
        n = prefix_store.save(path, self.kv, self.caches, self._prefix_stamp)
        log.info("prefix cache: %d blocks written to %s in %.2fs", n, path, time.monotonic() - t0)

    def _classifier(self) -> tuple[list[str] | None, list[int] | None]:
        """A classifier's labels, and a token classifier's ids (ValueError: a label that is no token)."""
        labels = classifier_labels(self.source.config)
        if not labels:
            return None, None
        if has_score_head(self.source.config):
            log.info("a sequence classifier: labels %s from its score head at the last position", labels)
            return labels, None
        tok = self.source.tokenizer
        if tok is None:
            raise ValueError("classifier_from_token needs the model's tokenizer")
        ids = [tok.convert_tokens_to_ids(t) for t in labels]
        if None in ids:
            raise ValueError(f"classifier_from_token: {labels[ids.index(None)]!r} is not a token of this model")
        log.info("a token classifier: labels %s (token ids %s) at the last position", labels, ids)
        return labels, ids

    def _init_speculation(self) -> None:
        if self.spec and self.plan.max_rollback is not None and self.plan.max_rollback < self.spec.num_speculative_tokens:
            raise ValueError(f"speculative decoding rolls back rejected drafts, and this model's cache can roll "
                             f"back {self.plan.max_rollback} tokens (max_rollback_tokens)")
        self.proposer = make_proposer(self.spec, self.runner, self.draft, self.info.vocab_size) if self.spec else None
        if self.spec:
            self.stats.spec_decode_num_accepted_tokens_per_pos = [0] * self.spec.num_speculative_tokens
            log.info("speculative decoding: %s, %d tokens per step%s", self.spec.method,
                     self.spec.num_speculative_tokens,
                     f", off above {self.spec.disable_by_batch_size} running requests"
                     if self.spec.disable_by_batch_size else "")
        self._spec_logged = (time.monotonic(), 0, 0, 0)   # time, drafts, draft tokens, accepted
        # A step's drafts need the previous step's tokens on the host.
        self.async_scheduling = self.args.async_scheduling and self.proposer is None
        if self.args.async_scheduling and not self.async_scheduling:
            log.info("asynchronous scheduling off: speculative decoding drafts from each step's tokens")
        self.runner.share_tokens = self.async_scheduling and self.tp > 1
        if self.async_scheduling:
            log.info("asynchronous scheduling: each step is launched while the one before runs%s",
                     "; its sampled tokens shared with the other ranks on the device" if self.tp > 1 else "")
        self.inflight = None     # (scheduled, launched step) not yet collected

    # -- requests -------------------------------------------------------------
    def add_request(self, er: EngineRequest) -> None:
        if self.asleep is not None:
            raise EngineSleeping("the engine is sleeping: wake it up first (wake_up, POST /wake_up)")
        check_request(er.prompt_token_ids, er.params, self.max_model_len, self.info.vocab_size,
                      self.args.max_logprobs)
        if er.request_id in self.scheduler.requests:
            raise InvalidRequest(f"request id {er.request_id!r} is already running")
        if not er.eos_token_ids:
            er.eos_token_ids = self.info.eos_token_ids
        check_pooling(er.params, er.pooling, self.info)
        if er.lora is not None:
            self.add_lora(er.lora)
        if er.mm_items:
            if self.info.no_images:
                raise InvalidRequest(self.info.no_images)
            try:
                check_items(er.mm_items, len(er.prompt_token_ids), self.args.max_num_batched_tokens)
            except ValueError as e:
                raise InvalidRequest(str(e)) from None
        req = Request(er, self.max_model_len)
        if er.params.bad_words:
            req.bad_words_ids = token_sequences(self.source.tokenizer, er.params.bad_words)
        so = er.params.structured_outputs
        if so is not None:
            try:
                req.grammar = GrammarState.start(self._grammar_compiler(), so)
            except StructuredOutputError as e:
                raise InvalidRequest(str(e)) from None
        self.scheduler.add(req)

    def add_lora(self, lora: LoRARequest) -> None:
        """Read and check an adapter (InvalidRequest if LoRA is off or it does not fit the model)."""
        if self.loras is None:
            raise InvalidRequest(f"LoRA adapter {lora.lora_name!r} requested, but LoRA is not enabled "
                                 f"(start the engine with enable_lora / --enable-lora)")
        if lora.lora_int_id in self.loras.adapters:
            return
        try:
            self.loras.add(lora)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        log.info("LoRA adapter %s (id %d) read from %s", lora.lora_name, lora.lora_int_id, lora.lora_path)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's; benchmarks start cold with it).
        False, and nothing forgotten, while requests hold KV blocks."""
        if self.has_work():
            log.warning("the prefix cache was not reset: %d request(s) hold KV blocks", len(self.scheduler.requests))
            return False
        self.kv.reset_prefix_cache()
        log.info("prefix cache reset")
        return True

    # -- sleep mode (engine/sleep_mode.py) ---------------------------------------
    SLEEP_TAGS = ("weights", "kv_cache")

    def sleep(self, level: int = 1) -> bool:
        """vLLM's sleep: give back the KV pool and the weights' memory (level
        1: weights to host memory, 2: discarded) on every rank. False, and
        nothing given back, while requests hold KV blocks; asleep already:
        nothing more."""
        if not self.args.enable_sleep_mode:
            raise InvalidRequest("sleep mode is not enabled (start the engine with enable_sleep_mode / "
                                 "--enable-sleep-mode)")
        if level not in (1, 2):
            raise InvalidRequest(f"sleep level must be 1 or 2, got {level!r}")
        if self.has_work():
            log.warning("not going to sleep: %d request(s) hold KV blocks", len(self.scheduler.requests))
            return False
        if self.asleep is not None:
            return True
        t0 = time.monotonic()
        self.kv.reset_prefix_cache()        # the blocks' contents go
        freed = self._on_every_rank(Sleep(level), lambda: Worker.sleep(self, level, self.runner))
        if level == 2 and self.loras is not None:
            self.loras.forget_slots()
        log.info("asleep (level %d): %.1f MiB given back in %.2fs", level, freed / 2**20, time.monotonic() - t0)
        return True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's wake_up: take back what sleep gave, all of it or by tag
        ("weights" first, then "kv_cache", as an RL trainer updates the
        weights in between)."""
        tags = tuple(tags or self.SLEEP_TAGS)
        bad = [t for t in tags if t not in self.SLEEP_TAGS]
        if bad:
            raise InvalidRequest(f"wake_up tags are {' and '.join(self.SLEEP_TAGS)}, got {bad[0]!r}")
        if self.asleep is None:
            return
        t0 = time.monotonic()
        awake = self._on_every_rank(WakeUp(tags), lambda: Worker.wake_up(self, tags, self.runner))
        log.info("%s (%s) in %.2fs", "awake" if awake else "partly awake", ", ".join(tags), time.monotonic() - t0)

    def is_sleeping(self) -> bool:
        return self.asleep is not None

    def _on_every_rank(self, msg, run):
        """run() here after sending msg to the followers, which do the same;
        the heartbeat waits (both may run collectives: graph capture)."""
        followers = self.runner.followers
        if followers is None:
            return run()
        with followers.lock:
            followers.send(msg)
            return run()

    def remove_lora(self, lora_int_id: int) -> None:
        if self.loras is not None:
            self.loras.remove(lora_int_id)

    def prepare_grammars(self) -> None:
        """Build llguidance's tokenizer index (~0.2-0.3 s) on a thread now, so
        that the first constrained request does not hold up a step for it."""
        if self.source.tokenizer is not None:
            compiler = self._grammar_compiler()          # the index itself is built under its lock
            threading.Thread(target=lambda: compiler.tokenizer, daemon=True,
                             name="tqserve-grammar-tokenizer").start()

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            if self.source.tokenizer is None:
                raise StructuredOutputError("this model has no tokenizer, so its output cannot be constrained")
            self._grammars = GrammarCompiler.for_tokenizer(self.source.tokenizer, self.info.vocab_size,
                                                           self.info.eos_token_ids)
        return self._grammars

    def abort(self, request_ids) -> None:
        for rid in request_ids:
            self.scheduler.abort(rid)
        self._release_drafts()

    def _release_drafts(self) -> None:
        """What the proposer keeps for requests no longer running goes (a draft model's KV blocks)."""
        if self.proposer is not None:
            self.proposer.retain({r.request_id for r in self.scheduler.running})

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.inflight is not None

    def check_alive(self) -> None:
        """Raise if a tensor-parallel rank was lost while idle (the heartbeat's finding)."""
        if self.runner.followers is not None:
            self.runner.followers.check()

    def close(self) -> None:
        """Save the prefix cache (prefix_cache_file), stop the other tensor-parallel ranks."""
        try:
            self.save_prefix_cache()
        except OSError as e:
            log.error("prefix cache not saved to %s: %s", self.args.prefix_cache_file, e)
        if self.runner.followers is None:
            return
        self.runner.followers.close()
        for p in self.local_followers:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        from parallel.distributed import shutdown_distributed
        shutdown_distributed()
        self.runner.followers = None

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Keep a running request's first num_tokens tokens; forget the rest and
        their KV (speculative decoding's rejected drafts)."""
        self.scheduler.rollback(self.scheduler.requests[request_id], num_tokens)

    # -- one step -------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        if self.async_scheduling:
            return self._step_ahead()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return self._failed(sched)
        return self._failed(sched) + self._outputs(sched, self.runner.execute(sched))

    def _step_ahead(self) -> list[EngineCoreOutput]:
        """Asynchronous scheduling (vLLM's --async-scheduling): while the
        device runs a step, the host schedules and launches the next, as if
        each request that samples had its token already (a placeholder,
        read on the device by the next step), then waits for the first
        step's tokens and processes them. A request that the step in flight
        ends (EOS, stop) has one more step launched, whose token is dropped;
        one that reaches max_tokens is not scheduled again. When a request
        with a token in flight samples from its own previous tokens on the
        host (penalties, a grammar's mask), the next step's forward is
        launched ahead all the same and its sampling after the tokens arrive."""
        failed = []
        if self.inflight is None:
            sched = self.scheduler.schedule()
            failed = self._failed(sched)
            if not sched.scheduled:
                return failed
            self.inflight = (sched, self.runner.launch(sched))
        (sched, handle), self.inflight = self.inflight, None
        waiting_on = [r for r in handle.sampled if r.status == Status.RUNNING]
        for r in waiting_on:
            r.num_placeholders = int(r.num_output_tokens + 1 < r.max_tokens)
        self.scheduler.update(sched)
        deferred = any(r.num_placeholders and r.needs_own_tokens() for r in waiting_on)
        ahead = self.scheduler.schedule()
        failed += self._failed(ahead)
        if ahead.scheduled:
            self.inflight = (ahead, self.runner.launch(ahead, prev=handle, sample=not deferred))
        try:
            results = self.runner.collect(handle)
        finally:
            for r in waiting_on:
                r.num_placeholders = 0
        outputs = self._outputs(sched, results, updated=True)
        if self.inflight is not None:
            self.runner.sample_step(self.inflight[1])     # a no-op unless deferred
        return failed + outputs

    @staticmethod
    def _failed(sched) -> list[EngineCoreOutput]:
        """The requests the scheduler ended without running them (their adapter unreadable)."""
        for r in sched.failed:
            log.warning("request %s failed: %s", r.request_id, r.stop_reason)
        return [EngineCoreOutput(r.request_id, finish_reason=r.finish_reason, stop_reason=r.stop_reason)
                for r in sched.failed]

    def _outputs(self, sched, results, updated: bool = False) -> list[EngineCoreOutput]:
        """A finished step's tokens into its requests and outputs; the
        scheduler's update (unless done already), finished requests freed."""
        self.stats.steps_total += 1
        outputs, rejected = [], {}
        for s in sched.scheduled:
            req = s.req
            if req.status == Status.FINISHED:       # ended (or aborted) while its step was in flight
                continue
            out = None
            if req.request_id in results and req.max_tokens > 0:
                toks, lps = results[req.request_id]
                out = EngineCoreOutput(req.request_id, [], [] if lps[0] is not None else None)
                for tok, lp in zip(toks, lps):
                    req.append(tok)
                    out.new_token_ids.append(tok)
                    if lp is not None:
                        out.new_logprobs.append(lp)
                    if req.finish_reason is not None:
                        break
                if req.grammar is not None and req.grammar.failed:
                    log.warning("request %s: its grammar rejected token %d (%s); finished", req.request_id,
                                tok, req.grammar.failed)
                self.stats.generation_tokens_total += len(out.new_token_ids)
                if s.spec_token_ids:
                    # KV stays for the positions of the tokens now in token_ids.
                    rejected[req.request_id] = len(s.spec_token_ids) + 1 - len(out.new_token_ids)
                    self._count_spec(len(s.spec_token_ids), len(toks) - 1)
                    if req.spec_from_prediction:
                        req.prediction_accepted += len(toks) - 1
                        req.prediction_rejected += len(s.spec_token_ids) - (len(toks) - 1)
            elif req.request_id in results:        # max_tokens == 0: prompt only (scoring, embeddings)
                req.finish_reason = "length"
                out = EngineCoreOutput(req.request_id)
                if req.pooling is not None:
                    out.embedding = req.pooling.finish(req.pooled, req.num_prompt_tokens)
            if out is not None:
                if req.num_output_tokens <= len(out.new_token_ids):
                    out.num_cached_tokens = req.num_cached_tokens
                    out.first_scheduled_time = req.first_scheduled_time
                    out.prompt_logprobs = req.prompt_logprobs
                outputs.append(out)
        if not updated:
            self.scheduler.update(sched, rejected)
        if self.proposer is not None:
            # Before finished requests are freed: an MTP head's cache follows
            # their last step too, as the blocks and state snapshots that step
            # registered hold it.
            self._propose()
        for out in outputs:
            req = self.scheduler.requests[out.request_id]
            if req.finish_reason is not None:
                out.finish_reason, out.stop_reason = req.finish_reason, req.stop_reason
                out.stopped_on_token = req.stopped_on_token
                if req.prediction is not None:
                    out.prediction = (req.prediction_accepted, req.prediction_rejected)
                self.scheduler.finish(req)
        self._release_drafts()
        return outputs

    def _propose(self) -> None:
        """Drafts for the next step, for the running requests about to decode
        (the proposer is called every step: MTP's cache follows every step)."""
        running = self.scheduler.running
        limit = self.spec.disable_by_batch_size
        k = self.spec.num_speculative_tokens
        reqs, room = [], []
        for r in (running if not limit or len(running) <= limit else []):
            if r.num_computed_tokens == r.num_tokens - 1 and r.params.speculative and r.finish_reason is None:
                # The step samples 1 + accepted tokens: they must fit max_tokens and the context.
                n = min(k, r.max_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens)
                if n > 0:
                    reqs.append(r)
                    room.append(n)
        self._release_drafts()
        for r, d in zip(reqs, self.proposer.propose(reqs, room)):
            # A grammar keeps the drafts it would take (its masks follow them at verification).
            r.spec_token_ids = d if r.grammar is None else d[:r.grammar.valid_drafts(d)]

    def _count_spec(self, drafted: int, accepted: int) -> None:
        st = self.stats
        st.spec_decode_num_drafts_total += 1
        st.spec_decode_num_draft_tokens_total += drafted
        st.spec_decode_num_accepted_tokens_total += accepted
        for i in range(accepted):
            st.spec_decode_num_accepted_tokens_per_pos[i] += 1
        t0, d0, n0, a0 = self._spec_logged
        now = time.monotonic()
        if now - t0 >= 10:
            d, n, a = (st.spec_decode_num_drafts_total - d0, st.spec_decode_num_draft_tokens_total - n0,
                       st.spec_decode_num_accepted_tokens_total - a0)
            log.info("speculative decoding: mean acceptance length %.2f, draft acceptance rate %.1f%% "
                     "(%d drafts, %d draft tokens, %d accepted)", 1 + a / d, 100 * a / max(n, 1), d, n, a)
            self._spec_logged = (now, st.spec_decode_num_drafts_total, st.spec_decode_num_draft_tokens_total,
                                 st.spec_decode_num_accepted_tokens_total)

    def get_stats(self) -> EngineStats:
        s, st = self.scheduler, self.stats
        st.num_running, st.num_waiting = len(s.running), len(s.waiting)
        st.kv_cache_usage = self.kv.usage
        st.num_preemptions_total = s.stats.num_preemptions
        st.prefix_cache_queries_total = s.stats.prefix_cache_queries
        st.prefix_cache_hits_total = s.stats.prefix_cache_hits
        st.prompt_tokens_total = s.stats.prompt_tokens
        if self.loras is not None:
            st.max_lora = self.args.max_loras
            st.running_lora_adapters = sorted({r.lora.lora_name for r in s.running if r.lora is not None})
            st.waiting_lora_adapters = sorted({r.lora.lora_name for r in s.waiting if r.lora is not None})
        return st
