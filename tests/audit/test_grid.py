"""audit-grid's cell selection and its report (no audit is run here; the smoke test in
test_cli_smoke.py runs two tiny cells end to end)."""

import json

import pytest

from pdmask_lab.audit.grid import grid_markdown, select_cells


def test_cells_are_the_product_in_run_order():
    assert select_cells("tied,untied", "1024,4096", "128") == [
        (True, 1024, 128), (True, 4096, 128), (False, 1024, 128), (False, 4096, 128)]


def test_cells_option_restricts_and_keeps_the_run_order():
    got = select_cells("tied,untied", "1024,4096", "128,256", "untied-V4096-H256, tied-V1024-H128")
    assert got == [(True, 1024, 128), (False, 4096, 256)]


@pytest.mark.parametrize("cells", ["tied-V2048-H128", "tied-V1024-H128,untied-V1024-H64", "bogus"])
def test_a_cell_outside_the_grid_is_refused_by_name(cells):
    with pytest.raises(ValueError, match=r"^cells: .*not in the grid.*valid: tied-V1024-H128"):
        select_cells("tied,untied", "1024,4096", "128,256", cells)


def test_reproduce_line_names_the_cells_and_every_setting():
    s = {"out": "runs/g", "config": "configs/audit.yaml", "set_": [], "ties": "tied,untied", "vocab": "1024,4096",
         "hidden": "128,256", "cells": "tied-V1024-H128", "seeds": 24, "seed_offset": 0, "precision": None, "lag": 4,
         "delta": None, "lr": None, "sample_tokens": 4, "disagreement_tokens": -1, "instruments": "param,precond,own",
         "bootstrap": 2000, "jobs": 2, "fresh": False, "progress": False}
    md = grid_markdown({"settings": s, "cells": {}})
    line = next(x for x in md.splitlines() if x.startswith("pdmask audit-grid"))
    assert "--cells tied-V1024-H128" in line and "--seeds 24" in line and "--lag 4" in line
    assert line.endswith("--config configs/audit.yaml --out runs/g")
    assert "--precision" not in line  # None: the preset's own
    s["cells"] = ""
    line = next(x for x in grid_markdown({"settings": s, "cells": {}}).splitlines() if x.startswith("pdmask audit-grid"))
    assert "--cells" not in line


def _fp(**trainer):
    """A fingerprint as the audit writes it today (the trainer section as ``comparable`` puts it)."""
    from pdmask_lab.audit.command import _NEUTRAL_TRAIN_KEYS
    from pdmask.train.config import comparable, load_config

    t = {k: v for k, v in comparable(load_config(None, trainer).to_dict()).items() if k not in _NEUTRAL_TRAIN_KEYS}
    return json.loads(json.dumps({"audit": {"divergence": "topk_kl"}, "trainer": t, "model": "", "lag": 4},
                                 default=str))


def _flat_without(*names) -> dict:
    """The trainer section of an older version: the flat config, without the fields ``names``."""
    from pdmask.train.config import TrainConfig
    from pdmask.train.loss_spec import LOSS_ALIASES

    cfg = TrainConfig()
    flat = {k: v for k, v in cfg.to_dict().items() if k != "loss"}
    for short, path in LOSS_ALIASES.items():
        part, _, leaf = path.rpartition(".")
        flat[short] = (cfg.loss_fields[part] if part else cfg.loss_fields)[leaf]
    return json.loads(json.dumps({k: v for k, v in flat.items() if k not in names}, default=str))


def test_seeds_written_before_a_trainer_field_existed_resume_at_its_default(tmp_path):
    """A seed directory whose settings predate a trainer field (here: the off-policy
    corrections), in the flat version of the trainer config, is resumed when the field is
    at its default, refused when it is not."""
    from pdmask_lab.audit.command import _seed_dir

    new = _fp()
    old = {**new, "trainer": _flat_without("is_level", "is_mask")}
    (tmp_path / "seeds").mkdir()
    (tmp_path / "seeds" / "settings.json").write_text(json.dumps(old))
    _seed_dir(tmp_path, new, fresh=False)
    assert json.loads((tmp_path / "seeds" / "settings.json").read_text()) == new  # rewritten in today's terms
    (tmp_path / "seeds" / "settings.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match=r"trainer\.loss\.corrections\.is_mask differ"):
        _seed_dir(tmp_path, _fp(is_mask=True), fresh=False)
    # a known field that changed is refused as before
    with pytest.raises(ValueError, match=r"trainer\.lr differ"):
        _seed_dir(tmp_path, _fp(lr=1.0, is_mask=False), fresh=False)
