"""``pdmask model`` says once that it waits for the conversion lock, and for whom (issue 41):
it used to wait in silence while another process converted the same model. The line names
the holder's pid and command line (``/proc/locks``; else what a pdmask holder wrote into the
lock file), then the conversion goes on once the lock is free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .test_model_cache_faults import NAME, as_named, nm, tiny  # noqa: F401  (fixtures)


def _holder(lock, seconds):
    p = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\nf = open(sys.argv[1], 'a')\n"
                          "fcntl.flock(f, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(float(sys.argv[2]))\n",
                          str(lock), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_pdmask_model_says_once_whom_it_waits_for(tiny, as_named, tmp_path, cli_run):  # noqa: F811
    as_named(tiny)
    cache = tmp_path / "cache"
    root = nm.models_root(cache)
    root.mkdir(parents=True)
    entry = f"{NAME}-{nm.file_sha256(tiny)[:16]}-c{nm.CONVERSION_VERSION}"
    holder = _holder(root / f"{entry}.lock", 3)
    try:
        code, out, err = cli_run(["model", NAME, "--cache-dir", str(cache)])
    finally:
        holder.kill()
        holder.wait()
    assert code == 0, out
    waits = [ln for ln in err.splitlines() if "waiting for" in ln]
    assert len(waits) == 1, err
    assert f"waiting for process {holder.pid} (" in waits[0] and f"{entry}.lock" in " ".join(err.split())
    assert out.strip().splitlines()[-1].endswith(entry)  # then converted: the directory on stdout
    assert (root / f"{entry}.lock").read_text().startswith("pid ")  # whom a next waiter would name


def test_a_free_lock_is_taken_without_a_word(tiny, tmp_path, recwarn):  # noqa: F811
    nm.cached_conversion(tiny, "tiny", cache_dir=tmp_path / "cache")
    assert not [w for w in recwarn if "waiting for" in str(w.message)]


def test_lock_holder_falls_back_to_what_the_holder_wrote(tmp_path, monkeypatch):
    lock = tmp_path / "e.lock"
    lock.write_text("pid 4242: pdmask model smollm2-135m\n")
    real = nm.Path.read_text
    monkeypatch.setattr(nm.Path, "read_text",
                        lambda self, *a, **k: (_ for _ in ()).throw(OSError("no /proc")) if str(self) == "/proc/locks"
                        else real(self, *a, **k))
    assert nm.lock_holder(lock) == "process pid 4242: pdmask model smollm2-135m"
    lock.write_text("")
    assert nm.lock_holder(lock) == "another process"
