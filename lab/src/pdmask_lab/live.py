"""Live progress of the runs ``pdmask compare`` / ``pdmask ladder`` start as subprocesses
(``--jobs N``): one display, one line per running run with its step ``i/n``, its last
reward and its ETA.

A run's subprocess writes its console output to its log file, so the parent reads the
progress from the record the trainer appends after every step, the run's
``metrics.jsonl`` (``step``, ``reward``, ``wall_s``: seconds since the run's loop started in
that process). The ETA is the run's own pace so far, ``wall_s / (steps done in this
process)``, times the steps left; a resumed run counts from the step it resumed at.

On a terminal the display is a ``rich.live.Live`` table redrawn every poll; elsewhere (a
log file, a pipe, CI) one plain line every ``every`` seconds, so a log stays readable.
Naive equivalent: ``tail -n 1 RUN/metrics.jsonl`` for every running run, every minute.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

#: how many bytes of the end of a metrics.jsonl are read for its last record (a record is ~2 KB)
TAIL_BYTES = 1 << 16


def last_record(path: Path) -> dict | None:
    """The last complete JSON record of a ``metrics.jsonl`` (None when it has none yet or
    cannot be read: a run still setting up, or a line being written)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - TAIL_BYTES))
            tail = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line half written, or cut by the seek
        if isinstance(rec, dict) and "step" in rec:
            return rec
    return None


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


@dataclass
class Watched:
    """One running run: its name, directory, steps in all and log file."""
    name: str
    run_dir: Path
    steps: int
    log: Path
    #: the run's last step when it was started here (0 for a new run; a resumed run's, which its
    #: checkpoint may put a little earlier: the ETA then waits for the run to pass it)
    step0: int = field(init=False)

    def __post_init__(self) -> None:
        rec = last_record(self.run_dir / "metrics.jsonl")
        self.step0 = int(rec["step"]) if rec else 0

    def state(self) -> dict:
        """``step``, ``reward`` (the last step's mean reward), ``eval`` (the last held-out
        accuracy), ``eta_s`` (None until a step has been done here)."""
        rec = last_record(self.run_dir / "metrics.jsonl")
        step = int(rec["step"]) if rec else 0
        out = {"step": step, "reward": rec.get("reward") if rec else None,
               "eval": rec.get("eval_accuracy") if rec else None, "eta_s": None}
        done_here = step - self.step0
        if rec and done_here > 0 and rec.get("wall_s"):
            out["eta_s"] = rec["wall_s"] / done_here * max(self.steps - step, 0)
        return out

    def line(self) -> str:
        s = self.state()
        reward = "-" if s["reward"] is None else f"{s['reward']:.3f}"
        ev = "" if s["eval"] is None else f" eval {s['eval']:.3f}"
        return f"{self.name} step {s['step']}/{self.steps} reward {reward}{ev} ETA {_duration(s['eta_s'])}"


class RunsProgress:
    """The live display of the runs of one compare / ladder invocation.

    ``with RunsProgress(console, total) as p:`` then ``p.started(...)`` / ``p.finished(name)``
    as runs start and end, and ``p.refresh()`` on every poll of the scheduler."""

    def __init__(self, console, total: int, *, every: float = 30.0):
        self.console, self.total, self.every = console, total, every
        self.running: dict[str, Watched] = {}
        self.done = 0
        self._live = None
        self._last_line = 0.0

    # -------------------------------------------------------------- scheduler events
    def started(self, name: str, run_dir: Path, steps: int, log: Path, how: str = "started") -> None:
        self.running[name] = Watched(name, Path(run_dir), int(steps), Path(log))
        self.console.print(f"{how} {name} (log: {log})", markup=False, soft_wrap=True)
        self.refresh()

    def finished(self, name: str) -> None:
        self.running.pop(name, None)
        self.done += 1
        self.console.print(f"finished {name} ({self.done} of {self.total} runs)", markup=False, soft_wrap=True)
        self.refresh()

    # -------------------------------------------------------------- display
    def header(self) -> str:
        waiting = self.total - self.done - len(self.running)
        return f"{self.done} of {self.total} runs finished, {len(self.running)} running, {waiting} waiting"

    def table(self):
        from rich.table import Table

        t = Table(title=self.header(), title_justify="left")
        for c in ("run", "step", "reward", "eval", "ETA", "log"):
            t.add_column(c, overflow="fold")
        for w in self.running.values():
            s = w.state()
            t.add_row(w.name, f"{s['step']}/{w.steps}", "-" if s["reward"] is None else f"{s['reward']:.3f}",
                      "-" if s["eval"] is None else f"{s['eval']:.3f}", _duration(s["eta_s"]), str(w.log))
        return t

    def refresh(self, *, force: bool = False) -> None:
        if self._live is not None:
            self._live.update(self.table())
            return
        now = time.time()
        if self.running and (force or now - self._last_line >= self.every):
            self._last_line = now
            self.console.print("progress: " + self.header() + " | " + " | ".join(w.line() for w in self.running.values()),
                               markup=False, soft_wrap=True)

    def __enter__(self) -> "RunsProgress":
        if self.console.is_terminal:
            from rich.live import Live

            self._live = Live(self.table(), console=self.console, refresh_per_second=2, transient=True)
            self._live.__enter__()
        else:
            self._last_line = time.time()  # the first plain line after `every` seconds, not at once
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None
