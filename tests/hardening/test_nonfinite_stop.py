"""A diverging run stops at the first non-finite loss, gradient norm or weight (issue 41,
cause 4): one line naming the step, the values and what to change, exit 2; the step and the
values in the run's records (``metrics.jsonl``'s record under ``nonfinite``, ``summary.json``
under ``stopped``); no checkpoint of the non-finite weights, so ``--resume`` with a lower
``lr`` trains on. Reproduction: ``pdmask train --config configs/smoke.yaml lr=1e308 steps=4``."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers", reason="run tests need the 'train' extra")

from pdmask.train.finite import NonFinite, first_nonfinite, nonfinite_weights, watch  # noqa: E402
from pdmask.train.logging import read_jsonl  # noqa: E402

from .test_cli_config import one_line_error  # noqa: E402


def _w(loss, gn, ok=True):
    p = torch.nn.Parameter(torch.tensor([1.0, float("nan") if not ok else 2.0]))
    return watch(torch.tensor(loss), torch.tensor(gn), [p, torch.nn.Parameter(torch.ones(3))])


def test_first_nonfinite_finds_the_first_minibatch_and_its_values():
    assert first_nonfinite([_w(0.5, 1.0), _w(-0.2, 3.0)]) is None
    assert first_nonfinite([]) is None
    assert first_nonfinite([_w(0.5, 1.0), _w(float("nan"), float("nan")), _w(1.0, float("inf"))]) == {
        "minibatch": 2, "of": 3, "loss": "nan", "grad_norm": "nan", "weights": "finite"}
    assert first_nonfinite([_w(0.5, float("inf"))])["grad_norm"] == "inf"
    # finite loss and gradient, an update that overflowed a weight
    assert first_nonfinite([_w(0.5, 1.0, ok=False), _w(0.1, 1.0)]) == {
        "minibatch": 1, "of": 2, "loss": 0.5, "grad_norm": 1.0, "weights": "non-finite"}


def test_nonfinite_weights_counts_and_names_the_first():
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.tensor([1.0, float("inf"), float("nan")]))
    assert nonfinite_weights([a, b], {id(a): "a", id(b): "b"}) == {
        "nonfinite_weights": 2, "weights": 7, "first_nonfinite_parameter": "b"}


def _args(tmp_path, smoke, cache, *extra):
    return ["train", "--config", smoke, f"out_dir={tmp_path}", f"cache_dir={cache}", "name=div", "progress=false",
            "tensorboard=false", "steps=4", "checkpoint_every=1", *extra]


def test_a_diverging_lr_stops_at_the_first_nonfinite_step_with_one_line(tmp_path, smoke, smoke_cache, cli_run):
    code, out, err = cli_run(_args(tmp_path, smoke, smoke_cache, "lr=1e308"))
    line = one_line_error(code, out, err, "step 1:", "non-finite", "weights", "lower lr (now 1e+308)")
    assert "Traceback" not in out
    run = tmp_path / "div"
    recs = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == [0, 1]  # nothing after the step that went non-finite
    stopped = recs[-1]["nonfinite"]
    assert stopped["step"] == 1 and stopped["weights"] == "non-finite" and stopped["nonfinite_weights"] > 0
    assert stopped["first_nonfinite_parameter"] in line
    # the mini-batch's loss and gradient norm were finite: the update overflowed the weights
    assert math.isfinite(stopped["loss"]) and math.isfinite(stopped["grad_norm"])
    summary = json.loads((run / "summary.json").read_text())  # strict JSON: no NaN written
    assert summary["stopped"] == stopped and summary["steps"] == 1
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
    # nothing a rerun trips over: --resume with a sane lr trains the run to its end
    code, out, err = cli_run(_args(tmp_path, smoke, smoke_cache, "lr=1e-3", "--resume"))
    assert code == 0, err
    recs = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4] and not any("nonfinite" in r for r in recs)
    assert "stopped" not in json.loads((run / "summary.json").read_text())


def test_the_library_raises_nonfinite_naming_the_step(tmp_path, smoke, smoke_cache):
    from pdmask.train.config import load_config
    from pdmask.train.grpo import train

    cfg = load_config(smoke, {"out_dir": str(tmp_path), "cache_dir": str(smoke_cache), "name": "div", "steps": 4,
                              "progress": False, "tensorboard": False, "lr": 1e30, "grad_clip": 0.0})
    with pytest.raises(NonFinite) as e:
        train(cfg)
    assert str(e.value).startswith(f"step {e.value.record['step']}: the run went non-finite")
    assert "clip the gradient (grad_clip > 0; now off)" in str(e.value) and "\n" not in str(e.value)
