"""Config loading: unknown keys and bad values are named in the error."""

import math

import pytest

from pdmask.train.config import FIELDS, TrainConfig, field_help, load_config, parse_override, replace


def test_every_field_has_help():
    for name, f in FIELDS.items():
        assert f.metadata.get("help"), name
    assert {r[0] for r in field_help()} == set(FIELDS)


def test_unknown_override_key_is_named_with_valid_names():
    with pytest.raises(ValueError) as e:
        load_config(None, ["lerning_rate=0.1"])
    msg = str(e.value)
    assert msg.startswith("lerning_rate:") and "valid names are:" in msg and "sft_lr" in msg


def test_unknown_yaml_key_is_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("steps: 3\ngroup_sise: 4\n")
    with pytest.raises(ValueError, match=r"^group_sise: unknown config key in .*c\.yaml.*did you mean group_size"):
        load_config(p)


@pytest.mark.parametrize("override, key", [
    ("steps=abc", "steps"), ("mode=ppo", "mode"), ("engine_precision=int8", "engine_precision"),
    ("lr=-1", "lr"), ("minibatches=3", "minibatches"), ("delta_high=0", "delta_high"),
    ("mode=pdm-full-kl", "full_logits"), ("task=jsonl", "train_file"), ("max_steps=0", "max_steps"),
])
def test_bad_values_name_the_field(override, key):
    with pytest.raises(ValueError, match=rf"^{key}:"):
        load_config(None, [override])


def test_override_parsing_and_types(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("lr: 3e-4\nsteps: 5\n")  # PyYAML reads 3e-4 as a string; we accept it as a float
    cfg = load_config(p, ["full_logits=true", "delta_high=0.1", "is_cap=inf", "name=x"])
    assert cfg.lr == 3e-4 and isinstance(cfg.lr, float) and cfg.steps == 5
    assert cfg.full_logits is True and cfg.delta_high == 0.1 and math.isinf(cfg.is_cap)
    assert parse_override("delta_low=null") == ("delta_low", None)
    assert replace(cfg, steps=7).steps == 7 and cfg.steps == 5
    assert isinstance(load_config(None, []), TrainConfig)
