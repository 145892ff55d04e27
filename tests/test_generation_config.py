"""The model's recommended sampling settings (generation_config.json, a GGUF's
general.sampling.* keys) as defaults for what a request leaves unset, as
vLLM's --generation-config auto; --generation-config vllm / a folder, and
--override-generation-config."""
import asyncio
import json
from types import SimpleNamespace

import openai
import pytest

from engine import LLM, AsyncLLM, EngineArgs, SamplingParams
from model_zoo import generation_config as gc
from model_zoo.resolve import open_model
from tests.fixtures_models import write_tiny_gguf
from tests.test_server_fake_engine import FakeAsyncLLM, LiveServer
from tests.tiny_models import save_tiny_llama

QWEN3_LIKE = {"bos_token_id": 1, "do_sample": True, "eos_token_id": [2, 3], "temperature": 0.6, "top_k": 20,
              "top_p": 0.95, "min_p": 0.0, "repetition_penalty": 1.0, "max_new_tokens": 512,
              "transformers_version": "4.51.0"}


def write_config(folder, cfg) -> None:
    (folder / "generation_config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))


def test_hf_folder_keys_in_vllm_names(tmp_path):
    write_config(tmp_path, QWEN3_LIKE)
    # repetition_penalty 1.0 is transformers' default: vLLM's to_diff_dict drops it, as here.
    assert gc.from_hf_folder(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                           "max_tokens": 512}
    write_config(tmp_path, {"top_k": 50, "temperature": 1.0, "top_p": 1.0, "eos_token_id": 2})
    assert gc.from_hf_folder(tmp_path) == {}
    assert gc.from_hf_folder(tmp_path / "nowhere") == {}


@pytest.mark.parametrize("cfg, words", [
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"temperature": True}, "temperature must be a number"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"min_p": -0.1}, "min_p must be in [0, 1]"),
    ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ("[1, 2]", "expected a JSON object"),
    ("{temperature: 0.6", "not a readable JSON file"),
])
def test_bad_hf_files_are_named(tmp_path, cfg, words):
    write_config(tmp_path, cfg)
    with pytest.raises(gc.GenerationConfigError) as e:
        gc.from_hf_folder(tmp_path)
    assert words in str(e.value) and "generation_config.json" in str(e.value)


def test_gguf_sampling_keys(tmp_path):
    path = tmp_path / "s.gguf"
    write_tiny_gguf(path, sampling={"temp": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05,
                                    "penalty_repeat": 1.1, "penalty_last_n": 64})
    got = open_model(path, weights=False).generation_config
    assert got == {"temperature": pytest.approx(0.7), "top_k": 40, "top_p": pytest.approx(0.9),
                   "min_p": pytest.approx(0.05), "repetition_penalty": pytest.approx(1.1)}
    assert isinstance(got["top_k"], int)
    write_tiny_gguf(tmp_path / "none.gguf")
    assert open_model(tmp_path / "none.gguf", weights=False).generation_config == {}


def test_a_broken_file_costs_the_defaults_not_the_model(tmp_path, caplog):
    save_tiny_llama(tmp_path)
    write_config(tmp_path, {"temperature": -1})
    with caplog.at_level("WARNING"):
        source = open_model(tmp_path, weights=False)
    assert source.generation_config == {}
    assert "ignoring the generation config" in caplog.text and "temperature must be >= 0" in caplog.text


def test_engine_args_choose_and_override(tmp_path):
    model = SimpleNamespace(generation_config={"temperature": 0.6, "top_k": 20})
    assert EngineArgs().sampling_defaults(model) == {"temperature": 0.6, "top_k": 20}
    assert EngineArgs(generation_config="vllm").sampling_defaults(model) == {}
    write_config(tmp_path, {"top_p": 0.8, "max_new_tokens": 64})
    assert EngineArgs(generation_config=str(tmp_path)).sampling_defaults(model) == {"top_p": 0.8, "max_tokens": 64}
    over = EngineArgs(override_generation_config={"temperature": 0.3, "max_new_tokens": 9, "min_p": 0})
    assert over.sampling_defaults(model) == {"temperature": 0.3, "top_k": 20, "max_tokens": 9, "min_p": 0.0}
    for bad, words in ((dict(generation_config=str(tmp_path / "nowhere")), "auto, vllm or a folder"),
                       (dict(override_generation_config={"temp": 1}), "unknown key 'temp'"),
                       (dict(override_generation_config={"top_p": 0}), "top_p must be in (0, 1]")):
        with pytest.raises(ValueError) as e:
            EngineArgs(**bad).validate()
        assert words in str(e.value)


def test_cli_flags(capsys):
    from server.cli import build_parser
    a = build_parser().parse_args(["serve", "--generation-config", "vllm",
                                   "--override-generation-config", '{"temperature": 0.5}'])
    assert a.generation_config == "vllm" and a.override_generation_config == {"temperature": 0.5}
    assert build_parser().parse_args(["serve"]).generation_config == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--override-generation-config", "[1]"])
    assert "expected a JSON object" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama_gc")
    save_tiny_llama(d)
    write_config(d, {"bos_token_id": 1, "eos_token_id": 2, "top_k": 1, "max_new_tokens": 7})
    return d


def test_offline_llm_defaults(tiny_dir, caplog):
    prompt = [1, 17, 33, 50, 7, 99]
    with caplog.at_level("INFO"):
        llm = LLM(str(tiny_dir), kv_cache_memory=4 << 20, dtype="float32")
    assert "top_k=1, max_tokens=7" in caplog.text
    assert llm.get_default_sampling_params() == SamplingParams(top_k=1, max_tokens=7)
    # top_k 1 from the model: the default run is the greedy one, 7 tokens long.
    default = llm.generate([prompt])[0].outputs[0]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=7))[0].outputs[0]
    assert default.token_ids == greedy.token_ids
    assert len(default.token_ids) == 7 or default.finish_reason == "stop"
    plain = LLM(str(tiny_dir), kv_cache_memory=4 << 20, dtype="float32", generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_async_engine_reads_them(tiny_dir):
    async def main():
        eng = AsyncLLM(EngineArgs(model=str(tiny_dir), kv_cache_memory=4 << 20, dtype="float32",
                                  override_generation_config={"temperature": 0.25}))
        await eng.start()
        try:
            return eng.default_sampling
        finally:
            await eng.shutdown()
    assert asyncio.run(main()) == {"top_k": 1, "max_tokens": 7, "temperature": 0.25}


@pytest.fixture()
def server():
    fake = FakeAsyncLLM(max_model_len=256)
    fake.default_sampling = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 5}
    srv = LiveServer(fake)
    yield srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    srv.stop()


def test_requests_get_the_model_defaults_for_what_they_leave_unset(server):
    srv, client = server
    msgs = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model="fake", messages=msgs)
    p = srv.llm.params[-1]
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.max_tokens) == (0.6, 20, 0.95, 0.0, 5)
    client.chat.completions.create(model="fake", messages=msgs, temperature=0, top_p=0.5, max_tokens=9,
                                   extra_body={"top_k": -1})
    p = srv.llm.params[-1]
    # What the request gives wins, max_tokens too (vLLM would cap it at max_new_tokens).
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.0, 0, 0.5, 9)
    # The default never asks for more than the context has left.
    client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x" * 230}])
    assert srv.llm.params[-1].max_tokens == 256 - len(srv.llm.prompts[-1]) < 5
    client.completions.create(model="fake", prompt="hello")
    assert (srv.llm.params[-1].max_tokens, srv.llm.params[-1].temperature) == (5, 0.6)
    srv.llm.default_sampling = {"max_tokens": 100}
    client.completions.create(model="fake", prompt="hello")
    assert srv.llm.params[-1].max_tokens == 16        # completions' own default is the lower
    client.responses.create(model="fake", input="hi")
    assert (srv.llm.params[-1].max_tokens, srv.llm.params[-1].temperature) == (100, 1.0)
