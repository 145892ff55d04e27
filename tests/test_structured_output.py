"""Grammar-constrained decoding in the engine (engine/structured_output.py,
the sampler's mask) on SmolLM2: every constraint kind holds, unconstrained
requests in the same batch are unaffected, rollback and start_after follow
the tokens, bad constraints are clear errors."""
import json
import re

import numpy as np
import pytest
import torch

from engine import LLM, InvalidRequest, SamplingParams
from engine.sampler import _apply_mask, forbidden_device, forbidden_host
from engine.structured_output import (GrammarCompiler, StructuredOutputError, StructuredOutputsParams as SO,
                                      fill_bitmask, mask_words)
from test_async_scheduling import count_ahead

ARGS = dict(kv_cache_memory=64 << 20, max_model_len=1024, max_num_seqs=16)
PERSON = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 30},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "age", "color"]}


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m", **ARGS)


def greedy(n=80, **so):
    return SamplingParams(temperature=0, max_tokens=n, structured_outputs=SO(**so) if so else None)


def text(llm, prompt, params):
    return llm.generate([prompt], params)[0].outputs[0]


# -- unit ----------------------------------------------------------------------
def test_params_need_exactly_one_kind():
    with pytest.raises(StructuredOutputError, match="exactly one"):
        SO()
    with pytest.raises(StructuredOutputError, match="exactly one"):
        SO(regex="a", choice=["b"])
    assert SO(json_object=True).kind == "json_object"


@pytest.mark.parametrize("so, match", [
    (SO(json='{"type": "object", "properties": '), "json schema"),
    (SO(regex="(unclosed"), "regex"),
    (SO(grammar="start: undefined_rule"), "undefined_rule"),
    (SO(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "strin"),
])
def test_bad_constraints_name_the_problem(llm, so, match):
    compiler = llm.core._grammar_compiler()
    with pytest.raises(StructuredOutputError, match=match):
        compiler.check(so)


def test_mask_bits_apply_to_their_rows_only():
    torch.manual_seed(0)
    V = 70
    words = mask_words(V)
    assert words * 32 >= V
    mask = np.zeros((2, words), np.int32)
    allowed = [{0, 5, 31, 32, 63, 69}, {1, 2, 40}]
    for j, toks in enumerate(allowed):
        for t in toks:
            mask[j, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    logits = torch.randn(3, V)
    forbid = forbidden_host(mask, V)
    assert torch.equal(forbid, forbidden_device(torch.from_numpy(mask), V))   # the CUDA path's unpacking
    work = logits.clone()
    _apply_mask(work, torch.tensor([2, 0]), forbid)
    assert torch.equal(work[1], logits[1])                      # an unconstrained row is untouched
    for row, toks in ((2, allowed[0]), (0, allowed[1])):
        finite = set(torch.isfinite(work[row]).nonzero().flatten().tolist())
        assert finite == toks
        assert torch.equal(work[row, sorted(toks)], logits[row, sorted(toks)])
    every = logits[:2].clone()                                   # all rows constrained: in place
    _apply_mask(every, torch.tensor([0, 1]), forbid)
    assert set(torch.isfinite(every[0]).nonzero().flatten().tolist()) == allowed[0]


def test_fill_bitmask_matches_llguidance(llm):
    compiler = llm.core._grammar_compiler()
    from engine.structured_output import GrammarState

    class R:
        grammar = GrammarState.start(compiler, SO(choice=["yes", "no"]))
    rows, mask = fill_bitmask([type("U", (), {"grammar": None})(), R()])
    assert rows == [1]
    ref = np.frombuffer(R.grammar.matcher.compute_bitmask(), np.int32)
    W = mask_words(compiler.vocab_size)
    assert mask.shape[1] % 2 == 0 and not mask[0, W:].any() and not ref[W:].any()
    assert np.array_equal(mask[0, :W], ref[:W])
    tok = llm.tokenizer
    ok = {t for t in range(compiler.vocab_size) if mask[0, t // 32] >> (t % 32) & 1}
    assert tok.encode("yes", add_special_tokens=False)[0] in ok
    assert tok.encode(" maybe", add_special_tokens=False)[0] not in ok


def test_compiled_grammars_are_cached(llm):
    compiler = llm.core._grammar_compiler()
    g = SO(json=PERSON).to_llguidance()
    a, b = compiler.matcher(g), compiler.matcher(g)
    assert a is not b and g in compiler._cache
    assert a.consume_tokens(llm.tokenizer.encode('{"name', add_special_tokens=False))
    assert not b.is_error() and b.compute_bitmask() != a.compute_bitmask()   # copies advance alone


# -- engine --------------------------------------------------------------------
def test_json_schema_output_validates(llm):
    for prompt in ["Describe a person as JSON.", "Who is Bob?", "A list of fruit:"]:
        o = text(llm, prompt, greedy(120, json=PERSON))
        obj = json.loads(o.text)
        assert set(obj) == {"name", "age", "color"} and obj["color"] in ("red", "green", "blue")
        assert 0 <= obj["age"] <= 120 and len(obj["name"]) <= 30
        assert o.finish_reason == "stop"


def test_each_constraint_kind(llm):
    o = text(llm, "Is the sky blue? Answer:", greedy(10, choice=["yes", "no", "maybe not"]))
    assert o.text in ("yes", "no", "maybe not") and o.finish_reason == "stop"
    o = text(llm, "My phone number is", greedy(20, regex=r"\d{3}-\d{4}"))
    assert re.fullmatch(r"\d{3}-\d{4}", o.text)
    o = text(llm, "Some JSON about a cat:", greedy(80, json_object=True))
    assert isinstance(json.loads(o.text), dict)
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    o = text(llm, "Is water wet?", greedy(20, grammar=gbnf))
    assert o.text in ("The answer is yes.", "The answer is no.")
    lark = 'start: sum "="\nsum: NUM | NUM "+" NUM | NUM "+" NUM "+" NUM\nNUM: /[0-9]{1,3}/'
    o = text(llm, "Add some numbers:", greedy(20, grammar=lark))
    assert re.fullmatch(r"[0-9]{1,3}(\+[0-9]{1,3}){0,2}=", o.text) and o.finish_reason == "stop"


def test_sampled_constrained_rows(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=3, max_tokens=120, n=1,
                            structured_outputs=SO(json=PERSON))
    outs = llm.generate(["Describe a person as JSON."] * 4, params)
    for o in outs:
        obj = json.loads(o.outputs[0].text)
        assert obj["color"] in ("red", "green", "blue")


def test_batch_neighbours_unaffected(llm):
    prompts = ["The capital of France is", "Once upon a time", "def fib(n):"]
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone = [o.outputs[0].text for o in llm.generate(prompts, free)]
    mixed = llm.generate(prompts + ["Describe a person as JSON."] * 2,
                         [free] * 3 + [greedy(100, json=PERSON), greedy(10, choice=["a", "b"])])
    assert [o.outputs[0].text for o in mixed[:3]] == alone
    json.loads(mixed[3].outputs[0].text)
    assert mixed[4].outputs[0].text in ("a", "b")
    assert not llm.core.has_work() and llm.core.kv.num_used_blocks == 0


def test_async_scheduling_samples_grammars_late(llm):
    """With --async-scheduling, a constrained request's next step is launched
    ahead and sampled once its token arrived (its mask needs it); the
    others' stop strings end them a step late on the device, dropped: texts
    equal the synchronous engine's."""
    prompts = ["The capital of France is", "Once upon a time", "Describe a person as JSON.", "Pick one:"]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, stop=["."]),
              greedy(100, json=PERSON), greedy(10, choice=["a", "b"])]
    want = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in llm.generate(prompts, params)]
    ahead = LLM("smollm2-135m", async_scheduling=True, **ARGS)
    steps = count_ahead(ahead)
    got = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in ahead.generate(prompts, params)]
    assert got == want and want[1][1] == "stop"
    assert sum(late for _, late in steps) >= 10   # steps ran ahead while grammars were live
    got = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in ahead.generate(prompts[:2], params[:2])]
    assert got == want[:2]
    assert not ahead.core.has_work() and ahead.core.kv.num_used_blocks == 0


def test_invalid_constraint_is_invalid_request(llm):
    with pytest.raises(InvalidRequest, match="regex"):
        llm.generate(["x"], greedy(5, regex="(unclosed"))
    assert not llm.core.has_work()


def test_rollback_rewinds_the_grammar():
    llm = LLM("smollm2-135m", **ARGS, enable_prefix_caching=False)   # rollback needs it off today
    core = llm.core
    from engine.request import EngineRequest
    prompt = llm.tokenizer.encode("Describe a person as JSON.")
    ref = llm.generate([prompt], greedy(120, json=PERSON))[0].outputs[0].token_ids
    core.add_request(EngineRequest("rb", prompt, greedy(120, json=PERSON)))
    for _ in range(8):
        core.step()
    req = core.scheduler.requests["rb"]
    assert req.grammar.consumed == req.num_output_tokens == 8
    # As speculative decoding does: cut back to 3 accepted tokens, append the next one.
    core.rollback("rb", len(prompt) + 3)
    assert req.grammar.consumed == 3
    req.append(ref[3])
    assert req.grammar.consumed == 4
    while core.has_work():
        core.step()
    assert req.output_token_ids == ref           # the grammar followed the rollback


def test_start_after_waits_for_the_marker(llm):
    tok = llm.tokenizer
    marker = tuple(tok.encode("</think>", add_special_tokens=False))
    prompt = tok.encode("Think, then answer in JSON.", add_special_tokens=False)
    forced = prompt + tok.encode(" hmm, let me think.</think>", add_special_tokens=False)
    # The marker inside the prompt does not count: the grammar waits for it in the output.
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                       structured_outputs=SO(choice=["yes", "no"], start_after=marker))
    o = llm.generate([forced], p)[0].outputs[0]
    assert o.text not in ("yes", "no") and len(o.token_ids) == 6
    from engine.request import EngineRequest
    core = llm.core
    core.add_request(EngineRequest("sa", prompt, SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=SO(choice=["yes", "no"], start_after=marker))))
    req = core.scheduler.requests["sa"]
    assert not req.grammar.active
    # Feed the marker as output, as a thinking model would write it.
    for t in marker:
        req.append(t)
    assert req.grammar.active and req.grammar.consumed == 0
    while core.has_work():
        core.step()
    assert tok.decode(req.output_token_ids[len(marker):]) in ("yes", "no")
