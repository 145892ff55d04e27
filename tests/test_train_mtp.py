"""tests/bench/train_mtp.py in seconds: a very small DeepSeek-V4 with its MTP
head trained for a few steps on tinyshakespeare (its own small BPE), saved,
and served by the engine from the directory: the MTP weights arrive
(mtp_loaded, equal tensors, equal draft logits), greedy generation runs and
matches the trained model's own greedy tokens, and both losses went down."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams

BENCH = Path(__file__).resolve().parent / "bench" / "train_mtp.py"


@pytest.fixture(scope="module")
def tm():
    sys.path.insert(0, str(BENCH.parent))           # its bench_paths, as when run as a script
    spec = importlib.util.spec_from_file_location("train_mtp", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def trained(tm, tmp_path_factory, request):
    threads = torch.get_num_threads()
    request.addfinalizer(lambda: torch.set_num_threads(threads))   # train() sets it process-wide
    torch.manual_seed(0)
    text = tm.DATA.read_text(encoding="utf-8")[:60_000]
    train_text, held_text = tm.split_text(text)
    tok, specials = tm.build_tokenizer("bpe", train_text, 320)
    ids = torch.tensor(tok.encode(train_text).ids)
    config = tm.make_config(tok.get_vocab_size(), hidden=32, layers=3, seq_len=64, sliding_window=16,
                            hca_ratio=16, head_dim=32, eos_token_id=tok.token_to_id(specials["eos_token"]),
                            bos_token_id=tok.token_to_id(specials["bos_token"]))
    assert config["layer_types"] == ["sliding_attention", "compressed_sparse_attention",
                                     "heavily_compressed_attention"]
    model = tm.new_model(config, seed=0)
    # one thread: on 2 shared cores, two threads of such tiny ops can run 10x slower under load
    res = tm.train(model, ids, seq_len=64, steps=40, lr=1e-2, log_every=0, seed=0, threads=1)
    out = tm.save_model_dir(model, config, tok, specials, tmp_path_factory.mktemp("tiny_mtp") / "model")
    held = torch.tensor(tok.encode(held_text).ids)
    return model, res, out, tok, held


def test_losses_go_down(trained):
    _, res, _, _, _ = trained
    h = res["history"]
    assert res["steps"] == len(h) == 40
    first = [sum(x[i] for x in h[:5]) / 5 for i in (0, 1)]
    last = [sum(x[i] for x in h[-5:]) / 5 for i in (0, 1)]
    print(f"main {first[0]:.3f} -> {last[0]:.3f}, mtp {first[1]:.3f} -> {last[1]:.3f}")
    assert last[0] < first[0] - 0.5, (first, last)
    assert last[1] < first[1] - 0.5, (first, last)


def test_directory_files(trained):
    _, _, out, _, _ = trained
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (out / name).is_file(), name


def test_engine_loads_mtp_and_generates(tm, trained):
    model, _, out, tok, held = trained
    llm = LLM(str(out), block_size=4)
    served = llm.core.model
    assert served.has_mtp and served.mtp_loaded
    ours = model.state_dict()
    for k, v in served.state_dict().items():
        assert torch.equal(v.float(), ours[k].float()), k
    ids = held[:48]
    drafts = []
    with torch.no_grad():
        for m in (model, served):
            streams = m.forward_streams(ids, torch.arange(48), None)
            drafts.append(m.compute_logits(m.mtp_forward(ids[1:], streams[:-1], torch.arange(47), None)))
    assert torch.allclose(drafts[0], drafts[1], atol=1e-5)

    prompt = "ROMEO:\n"
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    gen = got.outputs[0].token_ids
    assert len(gen) == 8 and isinstance(got.outputs[0].text, str)
    seq = tok.encode(prompt).ids
    assert got.prompt_token_ids == seq
    with torch.no_grad():
        for _ in range(8):
            t = torch.tensor(seq)
            seq.append(int(model.compute_logits(model(t, torch.arange(len(seq)), None))[-1].argmax()))
    assert gen == seq[-8:]
    print(f"{prompt!r} -> {got.outputs[0].text!r}")


def test_evaluate(tm, trained):
    model, _, _, _, held = trained
    ev = tm.evaluate(model, held, seq_len=64, max_tokens=256)
    assert ev["tokens"] == 256
    for k in ("main_acc", "mtp_acc", "mtp_matches_main_top1"):
        assert 0.0 <= ev[k] <= 1.0
    assert ev["main_acc"] > 0.05 and ev["mtp_acc"] > 0.02, ev
