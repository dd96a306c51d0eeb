"""``tie_embeddings`` (trainer config): the built-in model with an untied output layer."""

import pytest

pytest.importorskip("transformers")

from pdmask.train.config import load_config, replace  # noqa: E402
from pdmask.train.model import build_model  # noqa: E402
from pdmask.train.sft import sft_key  # noqa: E402

TINY = {"vocab_size": 300, "hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32}


def test_default_is_tied_and_untied_has_its_own_head():
    cfg = load_config(None, TINY)
    assert cfg.tie_embeddings is True
    tied = build_model(cfg, 300, pad_id=0, eos_id=1, seed=0)
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    untied = build_model(replace(cfg, tie_embeddings=False), 300, pad_id=0, eos_id=1, seed=0)
    head, emb = untied.get_output_embeddings().weight, untied.get_input_embeddings().weight
    assert head is not emb and head.data_ptr() != emb.data_ptr()
    # one more V x H matrix of parameters
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(untied) - n(tied) == 300 * 16


def test_sft_cache_key_includes_it_and_keeps_the_tied_keys():
    cfg = load_config(None, TINY)
    assert sft_key(replace(cfg, tie_embeddings=False)) != sft_key(cfg)
    # the default's key does not mention the field: cache entries made before it existed stay valid
    import hashlib
    import json

    from pdmask.train import sft
    d = {k: getattr(cfg, k) for k in sft._KEY_FIELDS}
    d["train_file_sha"], d["eval_file_sha"] = "", ""
    d["version"], d["task_version"] = sft.SFT_VERSION, sft.TASK_VERSION
    assert sft_key(cfg) == hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def test_refused_with_a_model_path(tmp_path):
    with pytest.raises(ValueError, match="^tie_embeddings:"):
        load_config(None, {**TINY, "tie_embeddings": False, "model_path": str(tmp_path)})
    with pytest.raises(ValueError, match="tie_embeddings"):
        load_config(None, ["tie_embeddings=maybe"])
