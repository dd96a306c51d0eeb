"""Run outputs: ``metrics.jsonl`` (one record per step), TensorBoard events, ``config.yaml``.

Every record has ``step`` (completed RL steps; 0 is the SFT base before any update).
On resume the JSONL is cut back to the checkpoint's step and TensorBoard is opened
with ``purge_step`` so that re-run steps replace, not duplicate, the lost ones.

A write that fails (a full disk, a file-size limit) is an ``OSError`` naming the file,
TensorBoard's event file included: its writer thread keeps the error (it prints no
traceback of its own) and :class:`RunLogger` raises it at the step it happened.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .rundir import writing


def read_jsonl(path: str | Path) -> list[dict]:
    """Records of a metrics file; a torn last line (killed mid-write) is skipped, and so is
    a line that is not a JSON object. A file that is not text at all (random bytes) is a
    ValueError naming it."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    try:
        text = p.read_text()
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: not a JSON-lines file (byte 0x{e.object[e.start]:02x} at offset {e.start} is not "
                         "UTF-8 text)") from None
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def truncate_jsonl(path: str | Path, max_step: int) -> None:
    """Keep only records with ``step <= max_step`` (atomically rewritten)."""
    p = Path(path)
    if not p.exists():
        return
    keep = [r for r in read_jsonl(p) if r.get("step", 0) <= max_step]
    tmp = p.with_suffix(".tmp")
    with writing(tmp):
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    tmp.replace(p)


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


class _GuardedRecords:
    """The record writer of TensorBoard's writer thread, made to keep an ``OSError`` (a full
    disk, a file-size limit) instead of raising it in the thread: raised there, it prints
    the thread's traceback and reaches the caller later without a file name.
    :class:`RunLogger` raises the kept error in the main thread, naming the event file."""

    def __init__(self, inner):
        self.inner, self.error = inner, None

    def _call(self, fn, *args):
        if self.error is None:  # after a failure nothing more is written
            try:
                fn(*args)
            except OSError as e:
                self.error = e

    def write(self, data):
        self._call(self.inner.write, data)

    def flush(self):
        self._call(self.inner.flush)

    def close(self):
        try:
            self.inner.close()
        except OSError as e:
            self.error = self.error or e


def _guard_events(tb) -> tuple[_GuardedRecords | None, Path | None]:
    """Put :class:`_GuardedRecords` between TensorBoard's writer thread and its event file;
    returns it and the event file's path (None, None where TensorBoard's internals differ:
    its errors then still name the ``tb`` directory)."""
    ew = getattr(tb._get_file_writer(), "event_writer", None)
    aw = getattr(ew, "_async_writer", None)
    worker = getattr(aw, "_worker", None)
    if worker is None or not hasattr(aw, "_writer") or not hasattr(worker, "_record_writer"):
        return None, None
    guard = _GuardedRecords(aw._writer)
    aw._writer = worker._record_writer = guard
    name = getattr(ew, "_file_name", None)
    return guard, Path(name) if name else None


class RunLogger:
    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, purge_step: int | None = None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self._f = open(self.path, "a")
        self.tb = self._guard = None
        self.events = self.dir / "tb"  # the event file once TensorBoard has made it
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            with writing(self.events):
                self.tb = SummaryWriter(str(self.events), purge_step=purge_step)
                self.tb.flush()  # the first events written while this thread waits
            self._guard, events = _guard_events(self.tb)
            self.events = events or self.events

    def _tb_written(self) -> None:
        """Every event so far on disk; a failed write raised here, naming the event file."""
        with writing(self.events):
            self.tb.flush()
            if self._guard is not None and self._guard.error is not None:
                raise self._guard.error

    def log(self, record: dict) -> None:
        rec = {k: _clean(v) for k, v in record.items()}
        with writing(self.path):
            self._f.write(json.dumps(rec) + "\n")
            self._f.flush()
        if self.tb is not None:
            step = int(record["step"])
            with writing(self.events):
                for k, v in record.items():
                    if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                        self.tb.add_scalar(k, v, step)
            self._tb_written()  # once per record: a full disk is reported at the step it happened

    def close(self) -> None:
        self._f.close()
        if self.tb is not None:
            self._tb_written()
            with writing(self.events):
                self.tb.close()
