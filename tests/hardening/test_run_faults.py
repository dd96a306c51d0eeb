"""Faults around a run directory: the run-dir lock (a second process refused, a stale lock
from a killed process does not block), checksummed checkpoints (a corrupt or truncated
newest one falls back to the previous one and resumes bit-exactly; none usable names the
files), no pickles on resume (a pickle in a checkpoint is refused and never executed), a
full disk named in one line, the SFT cache readable by other users."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="run tests need the 'train' extra")

from pdmask.train import checkpoint as ck  # noqa: E402
from pdmask.train.config import load_config  # noqa: E402
from pdmask.train.grpo import TIME_KEYS, train  # noqa: E402
from pdmask.train.logging import read_jsonl  # noqa: E402
from pdmask.train.rundir import RunDirLocked, lock_run_dir, share_like_umask  # noqa: E402

from .test_cli_config import one_line_error  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def smoke_cfg(smoke, out, cache, **over):
    ov = {"out_dir": str(out), "cache_dir": str(cache), "name": "run", "progress": False, "tensorboard": False,
          "checkpoint_every": 1, "steps": 4, **over}
    return load_config(smoke, ov)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, smoke, smoke_cache):
    """A finished 4-step smoke run with checkpoints after steps 3 and 4 (keep_checkpoints=2)."""
    out = tmp_path_factory.mktemp("base-run")
    cfg = smoke_cfg(smoke, out, smoke_cache)
    train(cfg)
    return cfg.run_dir


def clone(run_dir: Path, dest: Path) -> Path:
    d = dest / "run"
    shutil.copytree(run_dir, d)
    return d


def records(run_dir):
    return [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in read_jsonl(run_dir / "metrics.jsonl")]


def flip_byte(path: Path, offset: int = -100):
    b = bytearray(path.read_bytes())
    b[offset] ^= 0x55
    path.write_bytes(bytes(b))


def rewrite_manifest(ckpt: Path):
    """Make the manifest match the files as they are now (an attacker who writes the run dir can)."""
    man = json.loads((ckpt / ck.MANIFEST).read_text())
    for name in man["files"]:
        data = (ckpt / name).read_bytes()
        man["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (ckpt / ck.MANIFEST).write_text(json.dumps(man))


# ---------------------------------------------------------------- checkpoint format
def test_checkpoint_layout_keep_two_and_no_pickles(base_run):
    names = sorted(p.name for p in ck.ckpt_root(base_run).iterdir())
    assert names == ["step-000003", "step-000004"]
    files = sorted(p.name for p in (ck.ckpt_root(base_run) / "step-000004").iterdir())
    assert files == sorted(["MANIFEST.json", "engine.safetensors", "model.safetensors", "optimizer.json",
                            "optimizer.safetensors", "rng.safetensors", "state.json"])
    for p in (ck.ckpt_root(base_run) / "step-000004").iterdir():
        assert not p.read_bytes().startswith(b"\x80")  # no pickle protocol header anywhere
    assert ck.verify(ck.ckpt_root(base_run) / "step-000004") is None
    state = json.loads((ck.ckpt_root(base_run) / "step-000004" / "state.json").read_text())
    assert state["step"] == 4 and set(state["rng"]) == {"python", "numpy"}


def test_optimizer_state_round_trips_exactly(base_run):
    sd = ck.load_optimizer_state(ck.ckpt_root(base_run) / "step-000004")
    assert isinstance(next(iter(sd["state"])), int)  # int keys survive JSON
    assert isinstance(sd["param_groups"][0]["betas"], tuple)
    tensors = {}
    tree = ck.encode_tree(sd, tensors)
    back = ck.decode_tree(json.loads(json.dumps(tree)), tensors)
    for k, v in sd["state"].items():
        for name, t in v.items():
            assert torch.equal(back["state"][k][name], t)
    assert back["param_groups"] == sd["param_groups"]


# ---------------------------------------------------------------- fallback
@pytest.mark.parametrize("damage", ["flip model", "truncate optimizer", "delete rng", "garble manifest"])
def test_corrupt_newest_checkpoint_falls_back_and_resumes_bit_exactly(damage, base_run, tmp_path, smoke,
                                                                      smoke_cache, capsys):
    run = clone(base_run, tmp_path)
    newest = ck.ckpt_root(run) / "step-000004"
    if damage == "flip model":
        flip_byte(newest / "model.safetensors")
        bad = "model.safetensors"
    elif damage == "truncate optimizer":
        p = newest / "optimizer.safetensors"
        p.write_bytes(p.read_bytes()[:-64])
        bad = "optimizer.safetensors"
    elif damage == "delete rng":
        (newest / "rng.safetensors").unlink()
        bad = "rng.safetensors"
    else:
        (newest / ck.MANIFEST).write_text("{not json")
        bad = ck.MANIFEST
    from rich.console import Console

    console = Console(width=400, force_terminal=False)
    cfg = smoke_cfg(smoke, tmp_path, smoke_cache)
    train(cfg, resume=True, console=console)
    out = capsys.readouterr().out
    assert "checkpoint step-000004 is not usable" in out and bad in out and "falling back to step-000003" in out
    assert records(run) == records(base_run)  # step 4 re-run from step 3: the same numbers


def test_no_usable_checkpoint_names_each_file(base_run, tmp_path, smoke, smoke_cache, cli_run):
    run = clone(base_run, tmp_path)
    flip_byte(ck.ckpt_root(run) / "step-000004" / "model.safetensors")
    p = ck.ckpt_root(run) / "step-000003" / "optimizer.json"
    p.write_text(p.read_text()[:-5])
    code, out, err = cli_run(["train", "--resume", "--config", smoke, f"out_dir={tmp_path}", f"cache_dir={smoke_cache}",
                              "name=run", "progress=false", "tensorboard=false"])
    one_line_error(code, out, err, "checkpoint", "step-000004", "model.safetensors", "step-000003", "optimizer.json")


def test_incomplete_checkpoint_is_ignored(base_run, tmp_path):
    run = clone(base_run, tmp_path)
    tmp = ck.ckpt_root(run) / ".tmp-step-000005"
    shutil.copytree(ck.ckpt_root(run) / "step-000004", tmp)  # killed before the rename
    (ck.ckpt_root(run) / "step-000006").mkdir()  # a directory without a manifest
    msgs = []
    assert ck.latest_checkpoint(run, warn=msgs.append).name == "step-000004"
    assert "step-000006" in msgs[0] and "MANIFEST.json is missing" in msgs[0]


# ---------------------------------------------------------------- weights only: no pickle is executed
class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


def test_a_pickle_in_a_checkpoint_is_refused_and_not_executed(base_run, tmp_path, smoke, smoke_cache, cli_run):
    run = clone(base_run, tmp_path)
    marker = tmp_path / "executed"
    newest = ck.ckpt_root(run) / "step-000004"
    torch.save({"state": _Evil(marker)}, newest / "optimizer.safetensors")  # a pickle under a safetensors name
    rewrite_manifest(newest)  # checksums match: only the format can stop it
    code, out, err = cli_run(["train", "--resume", "--config", smoke, f"out_dir={tmp_path}", f"cache_dir={smoke_cache}",
                              "name=run", "progress=false", "tensorboard=false"])
    one_line_error(code, out, err, "checkpoint", "optimizer.safetensors", "safetensors")
    assert not marker.exists()


def test_an_old_pickle_checkpoint_is_skipped_and_not_executed(base_run, tmp_path):
    run = clone(base_run, tmp_path)
    marker = tmp_path / "executed"
    old = ck.ckpt_root(run) / "step-000005"
    old.mkdir()
    torch.save({"step": 5, "rng": _Evil(marker)}, old / "state.pt")
    torch.save(_Evil(marker), old / "optimizer.pt")
    msgs = []
    assert ck.latest_checkpoint(run, warn=msgs.append).name == "step-000004"
    assert "old pickle format" in msgs[0] and "state.pt" in msgs[0]
    assert not marker.exists()
    with pytest.raises(ValueError, match="^checkpoint: .*old pickle format"):
        ck.load_weights(old, torch.nn.Linear(1, 1))
    assert not marker.exists()


def test_resume_never_unpickles(base_run, tmp_path, smoke, smoke_cache, monkeypatch):
    import pickle

    def refuse(*a, **k):
        raise AssertionError("unpickling on resume")

    run = clone(base_run, tmp_path)
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    cfg = smoke_cfg(smoke, tmp_path, smoke_cache, steps=5)
    train(cfg, resume=True)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")][-2:] == [4, 5]


# ---------------------------------------------------------------- the run-directory lock
HOLDER = """
import sys, time
from pdmask.train.rundir import lock_run_dir
lock = lock_run_dir(sys.argv[1])
print("locked", flush=True)
time.sleep(120)
"""


def test_second_process_is_refused_and_a_killed_holder_leaves_no_stale_lock(base_run, tmp_path, smoke, smoke_cache,
                                                                            cli_run):
    run = clone(base_run, tmp_path)
    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        args = ["train", "--resume", "--config", smoke, f"out_dir={tmp_path}", f"cache_dir={smoke_cache}", "name=run",
                "progress=false", "tensorboard=false"]
        code, out, err = cli_run(args)
        one_line_error(code, out, err, str(run), f"pid {holder.pid}", "in use")
        assert records(run) == records(base_run)  # nothing was written
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (run / ".lock").read_text().strip() == str(holder.pid)  # the stale lock file is still there...
    code, out, err = cli_run(args)  # ...and does not block: the kernel released the lock with its holder
    assert code == 0, err


def test_two_real_training_processes_on_one_run_dir(tmp_path, smoke, smoke_cache):
    """Two `pdmask train` processes started together on one run directory: exactly one runs,
    the other exits 2 with one line naming the directory and the first one's pid."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = [sys.executable, "-m", "pdmask.cli", "train", "--config", str(smoke), f"out_dir={tmp_path}",
            f"cache_dir={smoke_cache}", "name=run", "steps=6", "progress=false", "tensorboard=false"]
    first = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    lock = tmp_path / "run" / ".lock"
    t0 = time.time()
    while not (lock.exists() and lock.read_text().strip()) and first.poll() is None and time.time() - t0 < 120:
        time.sleep(0.05)
    second = subprocess.run(args, capture_output=True, text=True, env=env, timeout=240)
    first_out, first_err = first.communicate(timeout=600)
    assert first.returncode == 0, first_err
    assert second.returncode == 2, second.stderr
    one_line_error(2, second.stdout, second.stderr, "run", f"pid {first.pid}")
    steps = [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert steps == list(range(7))  # one writer: no interleaved or duplicated records


def test_lock_is_exclusive_within_a_process_and_released(tmp_path):
    a = lock_run_dir(tmp_path / "r")
    with pytest.raises(RunDirLocked, match=f"pid {os.getpid()}"):
        lock_run_dir(tmp_path / "r")
    a.release()
    lock_run_dir(tmp_path / "r").release()


# ---------------------------------------------------------------- a full disk
def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


class _FullFile:
    def write(self, *a):
        _enospc()

    def flush(self):
        pass

    def close(self):
        pass


def _full_metrics(monkeypatch):
    from pdmask.train import logging as L

    real = L.RunLogger.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        self._f.close()
        self._f = _FullFile()

    monkeypatch.setattr(L.RunLogger, "__init__", init)


def _full_config_yaml(monkeypatch):
    real = Path.write_text

    def wt(self, *a, **k):
        if self.name == "config.yaml":
            _enospc()
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", wt)


def _full_checkpoint(monkeypatch):
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", _enospc)


FULL = [("metrics", _full_metrics, "metrics.jsonl"), ("config", _full_config_yaml, "config.yaml"),
        ("checkpoint", _full_checkpoint, "model.safetensors")]


@pytest.mark.parametrize("where,patch,name", FULL, ids=[f[0] for f in FULL])
def test_full_disk_is_one_line_naming_the_file(where, patch, name, tmp_path, smoke, smoke_cache, cli_run,
                                               monkeypatch, base_run):
    patch(monkeypatch)
    code, out, err = cli_run(["train", "--config", smoke, f"out_dir={tmp_path}", f"cache_dir={smoke_cache}",
                              "name=full", "steps=1", "progress=false", "tensorboard=false"])
    one_line_error(code, out, err, name, "No space left on device", str(tmp_path / "full"))


def _train_under_file_size_limit(tmp_path, smoke, smoke_cache, limit_bytes, *over):
    """``pdmask train`` in a subprocess under ``ulimit -f`` (RLIMIT_FSIZE) with SIGXFSZ
    ignored: a write past the limit fails with EFBIG (os error 27), as on a full quota."""
    import resource

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONDONTWRITEBYTECODE="1")
    args = [sys.executable, "-m", "pdmask.cli", "train", "--config", str(smoke), f"out_dir={tmp_path}",
            f"cache_dir={smoke_cache}", "name=full", "progress=false", *over]
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, preexec_fn=limit)


def test_checkpoint_past_the_file_size_limit_is_one_line(tmp_path, smoke, smoke_cache, base_run):
    """safetensors reports the failed write as its own SafetensorError ('I/O error: File too
    large (os error 27)'), not an OSError: still one line naming the file."""
    r = _train_under_file_size_limit(tmp_path, smoke, smoke_cache, 150 * 1024, "steps=1", "checkpoint_every=1",
                                     "tensorboard=false")
    line = one_line_error(r.returncode, r.stdout, r.stderr, "File too large", str(tmp_path / "full"),
                          ".safetensors")
    assert "Traceback" not in r.stderr, line


def test_tensorboard_event_file_past_the_size_limit_is_one_line(tmp_path, smoke, smoke_cache, base_run):
    """The event file is written by TensorBoard's writer thread: its failure is one line
    naming the event file, and the thread prints no traceback of its own."""
    r = _train_under_file_size_limit(tmp_path, smoke, smoke_cache, 5000, "steps=4", "checkpoint_every=0",
                                     "tensorboard=true")
    line = one_line_error(r.returncode, r.stdout, r.stderr, "File too large", "events.out.tfevents.",
                          str(tmp_path / "full" / "tb"))
    assert "Traceback" not in r.stderr and "Exception in thread" not in r.stderr, line


@pytest.mark.parametrize("code,reason", [(errno.EFBIG, "File too large"), (errno.ENOSPC, "No space left on device")])
def test_safetensors_io_error_names_the_file_by_errno(code, reason, tmp_path):
    """The errno comes from safetensors' 'os error N', whatever the message's words."""
    from safetensors import SafetensorError

    from pdmask.train.rundir import writing

    p = tmp_path / "m.safetensors"
    with pytest.raises(OSError) as e, writing(p):
        raise SafetensorError(f"Error while serializing: I/O error: whatever the OS said (os error {code})")
    assert (e.value.errno, e.value.strerror, e.value.filename) == (code, reason, str(p))
    with pytest.raises(SafetensorError), writing(p):  # not an I/O error: left as it is
        raise SafetensorError("Error while deserializing header: HeaderTooLarge")


def test_full_disk_while_caching_the_sft_base(tmp_path, smoke, cli_run, monkeypatch):
    from transformers import PreTrainedModel

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", _enospc)
    cache = tmp_path / "cache"
    code, out, err = cli_run(["train", "--config", smoke, f"out_dir={tmp_path}", f"cache_dir={cache}",
                              "sft_steps=2", "steps=1", "progress=false", "tensorboard=false"])
    one_line_error(code, out, err, str(cache), "No space left on device")
    assert list(cache.iterdir()) == []  # no half-written cache entry


# ---------------------------------------------------------------- the run's own errors
def test_reward_returning_a_string_is_one_line(tmp_path, smoke, smoke_cache, cli_run, monkeypatch, base_run):
    (tmp_path / "badreward.py").write_text("def reward(text, answer):\n    return 'yes'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = cli_run(["train", "--config", smoke, f"out_dir={tmp_path}", f"cache_dir={smoke_cache}",
                              "reward=badreward:reward", "steps=1", "progress=false", "tensorboard=false"])
    one_line_error(code, out, err, "reward", "'yes' (str)")


# ---------------------------------------------------------------- the shared SFT cache
def test_sft_cache_is_readable_by_other_users(base_run, smoke_cache):
    entries = [p for p in smoke_cache.iterdir() if p.name.startswith("sft-")]
    assert entries
    umask = os.umask(0o022)
    os.umask(umask)
    for e in entries:
        assert stat.S_IMODE(e.stat().st_mode) == 0o777 & ~umask
        for f in e.rglob("*"):
            want = (0o777 if f.is_dir() else 0o666) & ~umask
            assert stat.S_IMODE(f.stat().st_mode) == want, f
            assert f.is_dir() or stat.S_IMODE(f.stat().st_mode) & 0o044  # group/other can read


def test_share_like_umask_respects_a_strict_umask(tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "entry"
    (d / "sub").mkdir(parents=True)
    save_file({"a": torch.zeros(1)}, str(d / "sub" / "m.safetensors"))
    assert stat.S_IMODE((d / "sub" / "m.safetensors").stat().st_mode) == 0o600  # what safetensors does
    old = os.umask(0o027)
    try:
        share_like_umask(d)
    finally:
        os.umask(old)
    assert stat.S_IMODE((d / "sub" / "m.safetensors").stat().st_mode) == 0o640
    assert stat.S_IMODE((d / "sub").stat().st_mode) == 0o750
