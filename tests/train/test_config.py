"""Config loading: unknown keys and bad values are named in the error; the loss is one
pdmask.PolicyLoss, set by nested keys or their short names, and the flat config.yaml of
older run directories still loads."""

import math
from pathlib import Path

import pytest

import pdmask
from pdmask.train.config import (
    FIELDS, TrainConfig, comparable, config_diff, field_help, load_config, parse_override, replace, stored_config,
)
from pdmask.train.loss_spec import LOSS_ALIASES, loss_leaves

ROOT = Path(__file__).resolve().parents[2]


def test_every_field_has_help():
    for name, f in FIELDS.items():
        assert f.metadata.get("help"), name
    rows = field_help()
    assert {r[0] for r in rows} == (set(FIELDS) - {"loss"}) | {f"loss.{p}" for p in loss_leaves()}
    assert all(r[3] for r in rows), [r[0] for r in rows if not r[3]]
    # every short name is a loss field, and its row says so
    assert set(LOSS_ALIASES.values()) <= set(loss_leaves())
    assert "short name: delta_low" in next(r[3] for r in rows if r[0] == "loss.thresholds.delta_low")


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
    assert cfg.full_logits is True and cfg.loss.thresholds.delta_high == 0.1 and math.isinf(cfg.loss.corrections.is_cap)
    assert parse_override("delta_low=null") == ("delta_low", None)
    assert replace(cfg, steps=7).steps == 7 and cfg.steps == 5
    assert isinstance(load_config(None, []), TrainConfig)


# ------------------------------------------------------------------ the one loss spec
def test_the_loss_is_one_policy_loss_set_by_nested_keys_or_short_names(tmp_path):
    dotted = load_config(None, ["loss.thresholds.delta_low=0.02", "loss.mode=dppo-topk-kl",
                                "loss.corrections.is_cap=3", "loss.sampling.temperature=0.7"])
    short = load_config(None, ["delta_low=0.02", "mode=dppo-topk-kl", "is_cap=3", "temperature=0.7"])
    y = tmp_path / "c.yaml"
    y.write_text("loss:\n  mode: dppo-topk-kl\n  thresholds: {delta_low: 0.02}\n  corrections: {is_cap: 3}\n"
                 "  sampling: {temperature: 0.7}\n")
    nested = load_config(y)
    assert isinstance(dotted.loss, pdmask.PolicyLoss)
    assert dotted.loss == short.loss == nested.loss
    assert dotted.loss.thresholds.delta_low == 0.02 and dotted.loss.thresholds.delta_high == 0.05  # the mode's
    assert dotted.loss.corrections.is_cap == 3.0 and dotted.loss.sampling.temperature == 0.7
    # the trainer's defaults: the core's, with clip-higher and no input checks on the hot path
    d = TrainConfig().loss
    assert d.thresholds.eps_high == 0.28 and d.validate is False and d.mode == "pdm-topk-kl"
    assert TrainConfig(loss=pdmask.PolicyLoss(mode="grpo")).loss.mode == "grpo"


def test_loss_errors_name_the_key_as_written():
    for over, msg in [(["delta_high=0"], r"^delta_high: must be a positive number"),
                      (["loss.thresholds.delta_high=0"], r"^loss\.thresholds\.delta_high: must be a positive number"),
                      (["loss.mode=nope"], r"^loss\.mode: unknown value 'nope'"),
                      (["loss.sampling.top_p=0"], r"^loss\.sampling\.top_p: "),
                      (["loss.thresholds.delta_lo=1"],
                       r"^loss\.thresholds\.delta_lo: unknown config key .*did you mean loss\.thresholds\.delta_low"),
                      (["loss=3"], r"^loss: expected a mapping")]:
        with pytest.raises(ValueError, match=msg):
            load_config(None, over)


def test_to_dict_is_nested_resolved_and_round_trips(tmp_path):
    """config.yaml records what the run uses: the mode's default delta and the IS cap in force
    as numbers, the mode's surrogate and divergence (issue 42); it loads back to the same run."""
    import yaml

    cfg = load_config(None, ["delta_low=0.02", "sampling_top_k=0", "rejection=", "mode=dppo-topk-tv"])
    d = cfg.to_dict()
    assert not set(d) & set(LOSS_ALIASES)  # stored nested only
    tv = pdmask.MODES["dppo-topk-tv"].default_delta
    assert d["loss"]["thresholds"] == {"delta_low": 0.02, "delta_high": tv, "eps_low": 0.2, "eps_high": 0.28,
                                       "dual_clip": None}  # resolved: the mode's delta where none was given
    assert d["loss"]["sampling"]["top_k"] is None and d["loss"]["corrections"]["rejection"] is None
    assert d["loss"]["corrections"]["is_cap"] == pdmask.Corrections().is_cap  # the cap in force
    assert d["mode_spec"] == {"surrogate": "dppo", "divergence": "topk_tv"}
    assert cfg.loss_fields["thresholds"]["delta_high"] is None  # as given, for replace()
    p = tmp_path / "config.yaml"
    p.write_text(yaml.safe_dump(d, sort_keys=False))
    back = load_config(p)
    assert back == cfg and back.to_dict() == d


def test_a_preset_mode_records_its_bounds_and_reloads(tmp_path):
    import yaml

    cfg = load_config(None, ["mode=cispo"])
    d = cfg.to_dict()
    assert (d["loss"]["corrections"]["is_floor"], d["loss"]["corrections"]["is_cap"]) == (0.8, 1.28)
    p = tmp_path / "config.yaml"
    p.write_text(yaml.safe_dump(d, sort_keys=False))
    assert load_config(p).to_dict() == d


def test_a_record_of_another_mode_under_the_same_name_is_refused(tmp_path):
    import yaml

    d = load_config(None, ["mode=pdm-topk-kl"]).to_dict()
    d["mode_spec"] = {"surrogate": "smooth", "divergence": "topk_kl"}
    p = tmp_path / "config.yaml"
    p.write_text(yaml.safe_dump(d, sort_keys=False))
    with pytest.raises(ValueError, match=r"^mode_spec: .* records mode 'pdm-topk-kl' as"):
        load_config(p)


def test_a_stored_run_compares_by_what_it_used_not_by_todays_default(monkeypatch):
    """A new record holds its deltas; an old one's null is the default at the time
    (RECORDED_BEFORE_42). Changing a mode's default now makes both differ from a fresh config
    of that mode, as they should: the fresh run would use another delta."""
    import dataclasses

    from pdmask.train.loss_spec import RECORDED_BEFORE_42

    new = load_config(None, ["mode=pdm-topk-kl"]).to_dict()
    old = {k: v for k, v in new.items() if k != "mode_spec"}
    old["loss"] = {**new["loss"], "thresholds": {**new["loss"]["thresholds"], "delta_low": None, "delta_high": None},
                   "corrections": {**new["loss"]["corrections"], "is_cap": None}}
    was = RECORDED_BEFORE_42["pdm-topk-kl"][2]
    assert comparable(old)["loss.thresholds.delta_high"] == was == comparable(new)["loss.thresholds.delta_high"]
    assert comparable(old)["mode_spec"] == new["mode_spec"]
    assert config_diff(old, load_config(None, ["mode=pdm-topk-kl"])) == {}
    m = pdmask.MODES["pdm-topk-kl"]
    monkeypatch.setitem(pdmask.MODES, "pdm-topk-kl", dataclasses.replace(m, default_delta=0.04))
    fresh = load_config(None, ["mode=pdm-topk-kl"])
    for stored in (old, new):
        assert config_diff(stored, fresh)["loss.thresholds.delta_high"] == (was, 0.04)


def test_replace_keeps_what_was_given():
    cfg = load_config(None, ["mode=pdm-topk-kl"])
    tv = replace(cfg, {"loss.mode": "pdm-topk-tv"})
    assert tv.loss.thresholds.delta_low == 0.15  # the new mode's default: the delta was not given
    assert replace(cfg, mode="dppo-topk-tv", seed=3).loss == tv.loss.__class__(
        mode="dppo-topk-tv", thresholds=pdmask.Thresholds(eps_high=0.28), validate=False)
    assert replace(load_config(None, ["delta_low=0.02"]), {"loss.mode": "pdm-topk-tv"}).loss.thresholds.delta_low == 0.02


def test_a_committed_flat_record_loads_and_equals_its_cell():
    """docs/results/real-rl/fp8-sync3/none-s0/config.yaml was written by the flat config
    (mode, delta_low, is_cap: 5.0, ...): it loads, and it is the spec's cell."""
    from pdmask_lab.ladder import load_spec, plan_cells

    rec = ROOT / "docs/results/real-rl/fp8-sync3/none-s0"
    stored = stored_config(rec)
    assert "delta_low" in stored and "loss" not in stored  # the flat version
    cfg = load_config(rec / "config.yaml")
    assert cfg.loss.mode == "none" and cfg.loss.thresholds.delta_low == 0.02 and cfg.engine_precision == "fp8"
    assert comparable(stored)["loss.corrections.is_cap"] == 5.0 == comparable(cfg.to_dict())["loss.corrections.is_cap"]
    spec = load_spec(ROOT / "configs/real-ladder.yaml")
    cell = next(c for c in plan_cells(spec, Path(spec.out)) if c.key == "fp8-sync3/none-s0")
    assert config_diff(stored, cell.cfg) == {}
    assert config_diff(stored, replace(cell.cfg, delta_low=0.05)) == {"loss.thresholds.delta_low": (0.02, 0.05)}
