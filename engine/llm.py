"""Offline batch inference in the shape vLLM users know:

    from engine import LLM, SamplingParams
    outs = LLM("smollm2-135m").generate(["Hello"], SamplingParams(max_tokens=32))
"""
import dataclasses
import itertools
import math
import sys
import time

from engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, check_width
from engine.engine_args import EngineArgs
from engine.engine_core import EngineCore, check_pooling, check_priority, check_request
from engine.errors import InvalidRequest
from engine.lora import LoRARequest
from engine.multimodal import PromptImages, chat_images
from engine.output_processor import OutputProcessor, child_params
from engine.outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                            EmbeddingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput)
from engine.pooling_params import PoolingParams, pair_token_ids
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams, log_sampling_defaults
from model_zoo.multimodal import image_processor_for


def is_token_prompt(p) -> bool:
    return isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p)


class LLM:
    def __init__(self, model: str, **engine_args):
        self.core = EngineCore(EngineArgs(model=model, **engine_args))
        self.tokenizer = self.core.source.tokenizer
        self.chat_template = self.core.source.chat_template
        self.default_sampling = self.core.args.sampling_defaults(self.core.source)
        self.default_pooling = self.core.args.pooling_defaults(self.core.source)
        log_sampling_defaults(self.default_sampling)
        self.processor = OutputProcessor(self.tokenizer)
        self.images = PromptImages(image_processor_for(self.core.source.config, self.core.source.path),
                                   self.tokenizer, self.core.args.image_limit(),
                                   self.core.args.max_num_batched_tokens)
        self._ids = itertools.count()

    def encode(self, prompt) -> tuple[str | None, list[int], list]:
        """(text or None, token ids, images: engine.multimodal items) of a
        prompt: text, token ids, or vLLM's dict with multi_modal_data."""
        if isinstance(prompt, dict):
            return self.images.encode_prompt(prompt, self.core.info.no_images)
        if is_token_prompt(prompt):
            return None, list(prompt), []
        if not isinstance(prompt, str):
            raise InvalidRequest(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer: give prompts as token ids")
        return prompt, self.tokenizer.encode(prompt), []

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None, priority: int = 0,
                    pooling: PoolingParams | None = None, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """pooling: an embedding request (params with max_tokens 0); cache_salt:
        only requests with the same salt share prefix-cache blocks;
        lora_request: the adapter it runs with (enable_lora)."""
        text, ids, items = self.encode(prompt)
        check_priority(priority, self.core.args.scheduling_policy)
        return self._add(text, ids, params, request_id, priority, pooling, cache_salt, lora_request, items)

    def _add(self, text, ids, params, request_id=None, priority: int = 0, pooling=None, cache_salt=None,
             lora=None, items=()) -> str:
        rid = request_id or str(next(self._ids))
        check_request(ids, params, self.core.max_model_len, self.core.info.vocab_size,
                      self.core.args.max_logprobs)
        check_pooling(params, pooling, self.core.info)
        if lora is not None:
            self.core.add_lora(lora)        # (checked before anything is queued)
        now = time.monotonic()
        cids = self.processor.add(rid, text, ids, params, now)
        for i, cid in enumerate(cids):
            self.core.add_request(EngineRequest(cid, ids, child_params(params, i), arrival_time=now,
                                                priority=priority, pooling=pooling, cache_salt=cache_salt,
                                                lora=lora, mm_items=list(items)))
        return rid

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter now (a request naming it first does the same)."""
        self.core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        self.core.remove_lora(lora_int_id)

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached block (False while requests hold KV blocks)."""
        return self.core.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """vLLM's: give back the KV pool and the weights' memory while idle
        (level 1: weights to host memory; 2: discarded, read again on waking).
        Needs enable_sleep_mode; raises while requests are unfinished."""
        if not self.core.sleep(level):
            raise RuntimeError("cannot sleep while requests are unfinished")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's: take back what sleep gave ("weights", "kv_cache"; default both)."""
        self.core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.core.is_sleeping()

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use without sampling params: vLLM's
        defaults under the model's recommended ones (--generation-config)."""
        return SamplingParams(**self.default_sampling)

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks, if any."""
        self.core.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def step(self) -> list[RequestOutput]:
        outs, to_abort = self.processor.process(self.core.step())
        self.core.abort(to_abort)
        return outs

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: list[int] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """priority: per prompt, with scheduling_policy "priority" (lower first; vLLM's argument);
        lora_request: the adapter of every prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, (str, dict)) or is_token_prompt(prompts):
            prompts = [prompts]
        params = sampling_params or self.get_default_sampling_params()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequest(f"{len(prompts)} prompts but {len(params)} sampling params")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise InvalidRequest(f"{len(prompts)} prompts but {len(priority)} priorities")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise InvalidRequest(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        # Validate every prompt before queueing any, so a bad one disturbs none.
        encoded = [self.encode(p) for p in prompts]
        for (_, ids, _), sp, pr, lora in zip(encoded, params, priority, loras):
            check_request(ids, sp, self.core.max_model_len, self.core.info.vocab_size,
                          self.core.args.max_logprobs)
            check_priority(pr, self.core.args.scheduling_policy)
            if lora is not None:
                self.core.add_lora(lora)
        order = [self._add(text, ids, sp, priority=pr, lora=lora, items=items)
                 for (text, ids, items), sp, pr, lora in zip(encoded, params, priority, loras)]
        done = self._run(order, use_tqdm)
        return [done[r] for r in order]

    def _run(self, order: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        """Step until nothing is left; the finished outputs by request id."""
        done: dict[str, RequestOutput] = {}
        t0 = time.monotonic()
        while self.core.has_work():
            for o in self.step():
                if o.finished:
                    done[o.request_id] = o
            if use_tqdm:
                print(f"\r{len(done)}/{len(order)} requests, {time.monotonic() - t0:.1f}s",
                      end="", file=sys.stderr, flush=True)
        if use_tqdm:
            print(file=sys.stderr)
        return done

    def beam_search(self, prompts, params: BeamSearchParams, lora_request: LoRARequest | None = None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: per prompt (a text, token ids, or vLLM's
        {"prompt": ...} / {"prompt_token_ids": ...}) its best beams
        (engine/beam_search.py); every prompt's beams run in the same steps."""
        if isinstance(prompts, (str, dict)) or is_token_prompt(prompts):
            prompts = [prompts]
        check_width(params, self.core.args.max_logprobs)
        searches = []
        for p in prompts:
            if isinstance(p, dict):
                p = p["prompt_token_ids"] if "prompt_token_ids" in p else p["prompt"]
            _, ids, _ = self.encode(p)
            check_request(ids, SamplingParams(max_tokens=params.max_tokens), self.core.max_model_len,
                          self.core.info.vocab_size)        # (the longest beam fits)
            searches.append(BeamSearch(ids, params, set(self.core.info.eos_token_ids)))
        if lora_request is not None:
            self.core.add_lora(lora_request)
        while live := [s for s in searches if not s.done]:
            order = [[self._add(None, b.tokens, s.step_params(), lora=lora_request) for b in s.live] for s in live]
            done = self._run([r for rids in order for r in rids], use_tqdm)
            for s, rids in zip(live, order):
                s.advance([done[r].outputs[0].logprobs[0] for r in rids])
        return [s.output(self.tokenizer) for s in searches]

    def embed(self, prompts, pooling_params: PoolingParams | None = None, use_tqdm: bool = False,
              lora_request: LoRARequest | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text or token ids), pooled as the model's
        files say unless pooling_params (vLLM's LLM.embed)."""
        return [EmbeddingRequestOutput(r, ids, EmbeddingOutput(v))
                for r, ids, v in self._pool(prompts, pooling_params or self.default_pooling, use_tqdm, lora_request)]

    def classify(self, prompts, use_tqdm: bool = False,
                 lora_request: LoRARequest | None = None) -> list[ClassificationRequestOutput]:
        """A classifier's label probabilities per prompt (vLLM's LLM.classify)."""
        return [ClassificationRequestOutput(r, ids, ClassificationOutput(v))
                for r, ids, v in self._pool(prompts, self.classifier_pooling(), use_tqdm, lora_request)]

    def score(self, data_1, data_2, use_tqdm: bool = False,
              lora_request: LoRARequest | None = None) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score: data_1 (one text, or one per text of data_2)
        against each of data_2. A classifier scores each pair as one input
        (the last label's probability: a yes/no reranker's "yes", a one-label
        head's sigmoid); other models by the cosine of the two texts'
        embeddings."""
        one, two = ([d] if isinstance(d, str) else list(d) for d in (data_1, data_2))
        if len(one) not in (1, len(two)):
            raise InvalidRequest(f"data_1 has {len(one)} texts and data_2 {len(two)}: give one, or one per data_2")
        pairs = list(zip(one * len(two) if len(one) == 1 else one, two))
        if self.core.info.classifier_labels is not None:
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer: it cannot score texts")
            done = self._pool([pair_token_ids(self.tokenizer, a, b) for a, b in pairs], self.classifier_pooling(),
                              use_tqdm, lora_request)
            return [ScoringRequestOutput(r, ids, ScoringOutput(v[-1])) for r, ids, v in done]
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        unit = dataclasses.replace(self.default_pooling, normalize=True, dimensions=None)
        vectors = {t: (ids, v) for t, (_, ids, v) in zip(texts, self._pool(texts, unit, use_tqdm, lora_request))}
        return [ScoringRequestOutput(str(i), vectors[b][0], ScoringOutput(math.fsum(
                    x * y for x, y in zip(vectors[a][1], vectors[b][1])))) for i, (a, b) in enumerate(pairs)]

    def classifier_pooling(self) -> PoolingParams:
        pooling = self.core.info.classifier_pooling()
        if pooling is None:
            raise InvalidRequest("this model is not a classifier (a ForSequenceClassification checkpoint, or a "
                                 "yes/no reranker with --hf-overrides '{\"classifier_from_token\": [...]}')")
        return pooling

    def _pool(self, prompts, pooling: PoolingParams, use_tqdm: bool,
              lora_request: LoRARequest | None) -> list[tuple[str, list[int], list[float]]]:
        """(request id, prompt ids, pooled result) per prompt."""
        if isinstance(prompts, str) or is_token_prompt(prompts):
            prompts = [prompts]
        params = SamplingParams(max_tokens=0)
        encoded = [self.encode(p) for p in prompts]
        for _, ids, _ in encoded:
            check_request(ids, params, self.core.max_model_len, self.core.info.vocab_size,
                          self.core.args.max_logprobs)
        order = [self._add(text, ids, params, pooling=pooling, lora=lora_request, items=items)
                 for text, ids, items in encoded]
        done = self._run(order, use_tqdm)
        return [(r, done[r].prompt_token_ids, done[r].embedding) for r in order]

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
             lora_request: LoRARequest | None = None, **template_kwargs) -> RequestOutput:
        from model_zoo.chat_template import render_chat
        if self.chat_template is None:
            raise InvalidRequest("this model has no chat template")
        messages, images = chat_images(messages)
        text = render_chat(self.chat_template, messages, bos_token=self.tokenizer.bos_token,
                           eos_token=self.tokenizer.eos_token, **template_kwargs)
        if images:          # (the template placed one placeholder per image: checked here)
            try:
                text = self.images.expand_text(text, len(images))
            except ValueError as e:
                raise InvalidRequest(str(e)) from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids
        return self.generate([prompt], sampling_params, lora_request=lora_request)[0]
