"""Integer options are range-checked before anything runs or is written (issue 41, causes 5
and 6): every integer config key and every integer flag of every command gives one line
naming it and exit code 2 past its bound (``seed=2**64``, ``threads=2**31`` used to die in
torch with "Overflow when unpacking long long" after the step-0 record was written);
``pdmask audit --seeds 1e20`` (not an integer) is one line too; ``pdmask compare --seeds
99999999999999999999`` is refused at once instead of planning one config per seed."""

from __future__ import annotations

import time
import typing

import pytest

pytest.importorskip("transformers", reason="the CLI needs the 'train' extra")

from pdmask.train.config import INT_MAX, INT_RANGES, MAX_JOBS, MAX_SEEDS, SEED_MAX, load_config  # noqa: E402

from .test_cli_config import one_line_error  # noqa: E402


@pytest.mark.parametrize("key", sorted(INT_RANGES))
def test_every_integer_config_key_has_an_upper_bound(key, smoke):
    lo, hi = INT_RANGES[key]
    with pytest.raises(ValueError) as e:
        load_config(smoke, {key: 2**64}).validate()
    assert str(e.value).startswith(f"{key}: must be at most {hi}"), str(e.value)
    assert hi <= INT_MAX or hi == SEED_MAX


@pytest.mark.parametrize("key", ["seed", "sft_seed", "task_seed", "eval_answers"])
def test_seeds_and_eval_answers_are_not_negative(key, smoke):
    with pytest.raises(ValueError, match=f"^{key}: must be >= 0"):
        load_config(smoke, {key: -1}).validate()


@pytest.mark.parametrize("key", ["sampling_top_k", "loss.sampling.top_k", "loss.compute.chunk_rows",
                                 "loss.aggregation.dp_size"])
def test_integer_loss_fields_are_bounded_naming_the_key_as_written(key, smoke):
    with pytest.raises(ValueError, match=f"^{key}: must be an integer of at most {INT_MAX}"):
        load_config(smoke, {key: 2**64})


@pytest.mark.parametrize("override,key,bound", [("seed=18446744073709551616", "seed", SEED_MAX),
                                                ("threads=2147483648", "threads", 1024),
                                                ("steps=99999999999999999999", "steps", INT_MAX)])
def test_train_refuses_before_writing_anything(tmp_path, smoke, cli_run, override, key, bound):
    code, out, err = cli_run(["train", "--config", smoke, f"out_dir={tmp_path / 'runs'}", "name=r",
                              f"cache_dir={tmp_path / 'cache'}", "progress=false", override])
    one_line_error(code, out, err, f"{key}: must be at most {bound}")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()  # a rerun trips over nothing


def _int_options():
    """(command, --flag) of every integer option of every registered command."""
    from pdmask.cli import app

    out = []
    for c in app.registered_commands:
        fn = c.callback.__wrapped__
        for name, tp in typing.get_type_hints(fn).items():
            if tp is int or int in typing.get_args(tp):
                out.append((c.name or fn.__name__, "--" + name.replace("_", "-")))
    return out


INT_OPTIONS = _int_options()


def test_the_commands_have_integer_options():
    assert {("compare", "--seeds"), ("compare", "--jobs"), ("audit", "--seeds"), ("ladder", "--jobs"),
            ("task-stats", "--batches"), ("audit-grid", "--seed-offset")} <= set(INT_OPTIONS)


@pytest.mark.parametrize("cmd,flag", INT_OPTIONS, ids=[f"{c}{f}" for c, f in INT_OPTIONS])
def test_every_integer_flag_past_its_bound_is_one_line(tmp_path, monkeypatch, cli_run, cmd, flag):
    monkeypatch.chdir(tmp_path)  # anything written would land here
    code, out, err = cli_run([cmd, flag, str(10**20)])
    one_line_error(code, out, err, f"{flag}: must be an integer in [")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,needle", [
    (["compare", "--jobs", "0"], "--jobs: must be an integer in [1, 1024]"),
    (["ladder", "--jobs", str(MAX_JOBS + 1)], f"--jobs: must be an integer in [1, {MAX_JOBS}]"),
    (["audit", "--seeds", str(MAX_SEEDS + 1)], f"--seeds: must be an integer in [1, {MAX_SEEDS}]"),
    (["audit", "--seed-offset", str(SEED_MAX), "--seeds", "2"], "--seeds: the last seed"),
    (["audit-grid", "--disagreement-tokens", "-2"], "--disagreement-tokens: must be an integer in [-1,"),
])
def test_bounds_of_particular_flags(tmp_path, monkeypatch, cli_run, args, needle):
    monkeypatch.chdir(tmp_path)
    one_line_error(*cli_run(args), needle)


def test_compare_with_a_huge_seed_count_is_refused_at_once(tmp_path, monkeypatch, cli_run, smoke):
    monkeypatch.chdir(tmp_path)
    t = time.perf_counter()
    code, out, err = cli_run(["compare", "--config", smoke, "--seeds", "99999999999999999999"])
    one_line_error(code, out, err, "--seeds: must be an integer in [1, 10000]")
    assert time.perf_counter() - t < 30


def test_plan_runs_bounds_the_seeds_for_library_callers(smoke):
    from pdmask_lab.compare import plan_runs

    cfg = load_config(smoke, {})
    t = time.perf_counter()
    with pytest.raises(ValueError, match=f"^seeds: must be at most {MAX_SEEDS}"):
        plan_runs(cfg, ["pdm-topk-kl"], 99999999999999999999, None, "out")
    with pytest.raises(ValueError, match="^seeds: the last seed"):
        plan_runs(load_config(smoke, {"seed": SEED_MAX}), ["pdm-topk-kl"], 2, None, "out")
    assert time.perf_counter() - t < 5
    assert len(plan_runs(cfg, ["pdm-topk-kl", "dppo-topk-kl"], 3, None, "out")) == 6


def test_a_ladder_spec_with_too_many_seeds_is_refused_before_planning(tmp_path, smoke):
    from pdmask_lab.ladder import load_spec

    spec = tmp_path / "l.yaml"
    spec.write_text(f"config: {smoke}\nmodes: [pdm-topk-kl]\nseeds: 99999999999999999999\n"
                    "rungs:\n  - {name: a}\n")
    with pytest.raises(ValueError, match=f"^seeds: must be at most {MAX_SEEDS}"):
        load_spec(spec)
    spec.write_text(f"config: {smoke}\nmodes: [pdm-topk-kl]\nseeds: 2\nseed0: {SEED_MAX}\nrungs:\n  - {{name: a}}\n")
    with pytest.raises(ValueError, match="^seed0: "):
        load_spec(spec)


@pytest.mark.parametrize("argv,needle", [
    (["audit", "--seeds", "1e20"], "'--seeds'"),
    (["compare", "--jobs", "two"], "'--jobs'"),
    (["train", "--bogus"], "--bogus"),
])
def test_a_usage_error_of_the_pdmask_command_is_one_line(capsys, argv, needle):
    """The installed ``pdmask`` command (pdmask.cli:main): typer's usage errors, an option that
    is not an integer included, are one ``error: ...`` line with exit code 2."""
    from pdmask.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    cap = capsys.readouterr()
    assert e.value.code == 2
    lines = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], cap.err
    assert "Traceback" not in cap.err + cap.out


def test_main_keeps_help_and_exit_codes(capsys):
    from pdmask.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "train" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["train", "group_size=1"])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: group_size:")
