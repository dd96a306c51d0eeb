"""Records hold no absolute path of the machine that wrote them (pdmask.train.portable)."""

import json
import os
import sys
from pathlib import Path

from pdmask.train.environment import environment
from pdmask.train.named_models import SOURCE_FILE
from pdmask.train.portable import portable_arg, portable_command, portable_config, portable_path


def test_cache_entries_are_named_by_their_entry(tmp_path):
    model = tmp_path / "anywhere" / "models" / "smollm2-135m-b179c9523d0e6a0f-c1"
    model.mkdir(parents=True)
    (model / SOURCE_FILE).write_text(json.dumps({"name": "smollm2-135m"}))
    sft = tmp_path / "cache" / "sft-3af0a1b2c3d4e5f6"
    sft.mkdir(parents=True)
    (sft / "sft.json").write_text("{}")
    assert portable_path(model) == "$PDMASK_CACHE/models/smollm2-135m-b179c9523d0e6a0f-c1"
    assert portable_path(str(sft)) == "$PDMASK_CACHE/sft-3af0a1b2c3d4e5f6"


def test_hub_snapshot_is_repo_at_revision():
    p = "/somewhere/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/12fd25f77366fa6b3b4b768ec3050bf629380bac"
    assert portable_path(p) == "HuggingFaceTB/SmolLM2-135M-Instruct@12fd25f77366fa6b3b4b768ec3050bf629380bac"


def test_relative_to_base_home_or_the_last_two_parts(tmp_path, monkeypatch):
    assert portable_path(tmp_path / "runs" / "a", base=tmp_path) == "runs/a"
    assert portable_path(tmp_path, base=tmp_path) == "."
    monkeypatch.chdir(tmp_path)
    assert portable_path(tmp_path / "x" / "y") == "x/y"  # base: the working directory
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")  # the home directory is not under it
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert portable_path(tmp_path / "home" / ".cache" / "f") == "~/.cache/f"
    assert portable_path("/definitely/not/here/file.yaml") == ".../here/file.yaml"
    assert portable_path("runs/x") == "runs/x" and portable_path("smollm2-135m") == "smollm2-135m"
    for p in ("/a/b/c", str(tmp_path / "q"), "/"):
        assert not os.path.isabs(portable_path(p)), p


def test_command_lines_and_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "configs" / "real-audit.yaml"
    assert portable_arg(str(cfg)) == "configs/real-audit.yaml"
    assert portable_arg(f"--config={cfg}") == "--config=configs/real-audit.yaml"
    assert portable_arg(f"cache_dir={tmp_path / 'c'}") == "cache_dir=c"
    assert portable_arg("--seeds") == "--seeds" and portable_arg("lr=1e-3") == "lr=1e-3"
    line = portable_command("pdmask", ["audit", "--config", str(cfg), "--instruments", "", "--out", "/x/y/z"])
    assert line == "pdmask audit --config configs/real-audit.yaml --instruments '' --out .../y/z"
    d = portable_config({"out_dir": str(tmp_path / "runs"), "cache_dir": "", "model_path": "smollm2-135m", "lr": 1.0})
    assert d == {"out_dir": "runs", "cache_dir": "", "model_path": "smollm2-135m", "lr": 1.0}


def test_environment_records_the_interpreter_by_name():
    exe = environment()["executable"]
    assert exe.startswith(Path(sys.executable).name) and "/" not in exe
    assert exe.endswith(" (venv)") == (sys.prefix != sys.base_prefix)


def test_a_runs_config_yaml_holds_no_absolute_path(tmp_path, monkeypatch):
    """open_run writes config.yaml with out_dir and cache_dir portable (relative to the working
    directory, ~/... under home, else their last two parts); read back, it is the same run
    (config_diff), its cache resolves to the same directory, and model_path stays as given."""
    import yaml

    from pdmask.train import grpo
    from pdmask.train.config import config_diff, load_config
    from pdmask.train.named_models import models_root
    from pdmask.train.sft import cache_root

    home, work = tmp_path / "home", tmp_path / "work"
    (work / "runs").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    monkeypatch.setattr(grpo, "setup", lambda cfg, console: "S")  # the writer, without the model
    model_dir = str(tmp_path / "models" / "mine")
    cfg = load_config(None, {"out_dir": str(work / "runs"), "cache_dir": str(home / ".cache" / "pdm"),
                             "model_path": model_dir, "name": "r"})
    assert grpo.open_run(cfg, resume=False, console=None) == ("S", 0)
    text = (work / "runs" / "r" / "config.yaml").read_text()
    stored = yaml.safe_load(text)
    assert stored["out_dir"] == "runs" and stored["cache_dir"] == "~/.cache/pdm"
    assert stored["model_path"] == model_dir  # compared when a stored run is reused: as given
    assert str(work) not in text.replace(model_dir, "") and str(home) not in text
    assert config_diff(stored, cfg) == {}
    back = load_config(work / "runs" / "r" / "config.yaml")
    assert cache_root(back) == home / ".cache" / "pdm" == cache_root(cfg)
    assert models_root(back.cache_dir) == home / ".cache" / "pdm" / "models"
    # outside the working directory and home: the last two parts, never the absolute path
    other = load_config(None, {"out_dir": "/elsewhere/deep/runs", "cache_dir": ""})
    assert grpo.recorded_config(other)["out_dir"] == ".../deep/runs" and grpo.recorded_config(other)["cache_dir"] == ""
