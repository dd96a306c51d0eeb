"""``pdmask ladder --prefix-of``: a finished longer run's first N steps are, record for
record, the N-step run of the same config (smoke preset, real runs), and a source that
cannot stand in is refused naming why."""

import json
import os
import re

import pytest
import torch
import yaml

from pdmask.train.config import load_config, replace
from pdmask.train.grpo import TIME_KEYS, train
from pdmask_lab.ladder import cell_status, load_spec, plan_cells, run_ladder
from pdmask_lab.ladder_report import build_report, wall_times
from pdmask.train.logging import read_jsonl
from pdmask_lab.prefix import PREFIX_KEY, take_prefix

# summary keys that depend on wall-clock time or on the machine, not on the run's numbers
_CLOCK = ("time_step_s_median", "time_update_s_median", "update_s_per_1k_tokens_median", "wall_s",
          "environment", PREFIX_KEY)


def _strip(recs):
    return [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in recs]


def _cfg(smoke_config, cache_dir, out, **kw):
    cfg = load_config(smoke_config, {"cache_dir": str(cache_dir), "tensorboard": False, "eval_every": 2,
                                     "mode": "dppo-topk-kl", "engine_precision": "fp8", "sync_every": 2})
    return replace(cfg, out_dir=str(out), progress=False, **kw)


@pytest.fixture(scope="module")
def long_and_short(tmp_path_factory, smoke_cache, smoke_config):
    d = tmp_path_factory.mktemp("prefix")
    long = _cfg(smoke_config, smoke_cache, d / "long", steps=4)
    short = _cfg(smoke_config, smoke_cache, d / "short", steps=2)
    train(long)
    train(short)
    return d, long, short


@pytest.mark.slow
def test_the_prefix_of_a_longer_run_is_the_shorter_run(long_and_short, smoke_config, smoke_cache):
    d, long, short = long_and_short
    want = _cfg(smoke_config, smoke_cache, d / "taken", steps=2)
    got = take_prefix(long.run_dir, want)
    assert got["source_steps"] == 4
    ran = read_jsonl(short.run_dir / "metrics.jsonl")
    taken = read_jsonl(want.run_dir / "metrics.jsonl")
    assert [r["step"] for r in taken] == [0, 1, 2]
    assert _strip(taken) == _strip(ran)  # the trainer's numbers, bit for bit
    s_ran = json.loads((short.run_dir / "summary.json").read_text())
    s_taken = json.loads((want.run_dir / "summary.json").read_text())
    assert {k: v for k, v in s_taken.items() if k not in _CLOCK} == {k: v for k, v in s_ran.items() if k not in _CLOCK}
    assert s_taken[PREFIX_KEY] == {"run": os.path.relpath(long.run_dir, want.run_dir), "steps": 4}  # no machine path
    assert (want.run_dir / s_taken[PREFIX_KEY]["run"]).resolve() == long.run_dir.resolve()
    assert yaml.safe_load((want.run_dir / "config.yaml").read_text())["steps"] == 2
    # the long run really went further (the test could fail if it did not)
    assert read_jsonl(long.run_dir / "metrics.jsonl")[-1]["step"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("kw,msg", [
    ({"steps": 3}, "no held-out evaluation at step 3"),
    ({"steps": 2, "lr": 2e-3}, r"differs in more than steps \(lr: 0.001 -> 0.002\)"),
    ({"steps": 4}, "is the same run"),
    ({"steps": 6}, "ran 4 steps, fewer than 6"),
])
def test_a_source_that_cannot_stand_in_is_refused_naming_why(long_and_short, smoke_config, smoke_cache, tmp_path,
                                                             kw, msg):
    d, long, _ = long_and_short
    want = _cfg(smoke_config, smoke_cache, tmp_path, **kw)
    with pytest.raises(ValueError, match="prefix_of: " + ".*" + msg):
        take_prefix(long.run_dir, want)
    assert not (want.run_dir / "metrics.jsonl").exists()


@pytest.mark.slow
def test_an_unfinished_source_is_refused(long_and_short, smoke_config, smoke_cache, tmp_path):
    d, long, _ = long_and_short
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.yaml").write_text((long.run_dir / "config.yaml").read_text())
    (src / "summary.json").write_text((long.run_dir / "summary.json").read_text())
    recs = read_jsonl(long.run_dir / "metrics.jsonl")
    (src / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[:4]))  # steps 0-3 of 4
    want = _cfg(smoke_config, smoke_cache, tmp_path / "w", steps=2)
    with pytest.raises(ValueError, match=re.escape("is not finished (last step 3 of 4)")):
        take_prefix(src, want)


@pytest.mark.slow
def test_ladder_takes_prefixes_then_runs_only_the_rest(tmp_path, smoke_cache, smoke_config):
    def spec_at(steps, seeds):
        p = tmp_path / f"s{steps}-{seeds}.yaml"
        p.write_text(yaml.safe_dump({
            "name": "cut", "config": str(smoke_config), "modes": ["none", "pdm-topk-kl"], "seeds": seeds,
            "set": {"steps": steps, "eval_every": 2, "tensorboard": False, "cache_dir": str(smoke_cache)},
            "rungs": [{"name": "lag", "set": {"engine_precision": "fp8", "sync_every": 2}}]}))
        return load_spec(p)

    run_ladder(spec_at(4, 1), out=tmp_path / "long")
    short = spec_at(2, 2)
    with pytest.raises(ValueError, match="prefix_of: directory .* not found"):
        run_ladder(short, out=tmp_path / "short", prefix_of=tmp_path / "nowhere")
    r = run_ladder(short, out=tmp_path / "short", prefix_of=tmp_path / "long")
    assert r["prefix"] == 2 and r["executed"] == {"fresh": 2, "resume": 0}  # seed 1 had no longer run
    cells = plan_cells(short, tmp_path / "short")
    assert all(cell_status(c) == "done" for c in cells)
    log = read_jsonl(tmp_path / "short" / "ladder_log.jsonl")
    assert sorted(x["cell"] for x in log if x["event"] == "prefix") == ["lag/none-s0", "lag/pdm-topk-kl-s0"]
    w = wall_times(tmp_path / "short")
    assert w["cells_prefix"] == 2 and w["cells_fresh"] == 2 and w["prefix_source_wall_s"] > 0
    build_report(short, tmp_path / "short", plot=False)
    assert "2 cells are the first steps of longer runs" in (tmp_path / "short" / "ladder.md").read_text()
    # a second invocation finds everything done and takes nothing again
    assert run_ladder(short, out=tmp_path / "short", prefix_of=tmp_path / "long")["prefix"] == 0


@pytest.mark.slow
def test_a_run_gives_the_callers_thread_count_back(smoke_config, smoke_cache, tmp_path):
    """``train`` sets the config's torch threads for the run and restores the caller's after it
    (a library user, or a ladder running cells in one process, keeps its own)."""
    cfg = _cfg(smoke_config, smoke_cache, tmp_path, steps=1)
    before = torch.get_num_threads()
    caller = 2 if cfg.threads == 1 else 1
    torch.set_num_threads(caller)
    try:
        train(cfg)
        assert torch.get_num_threads() == caller != cfg.threads
    finally:
        torch.set_num_threads(before)
