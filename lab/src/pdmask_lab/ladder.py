"""``pdmask ladder``: mask modes x seeds on rungs of increasing training-inference mismatch.

A **ladder** is a list of rungs (engine settings such as ``fp32``, ``bf16``, ``fp8`` +
policy lag), each run for every mode and seed on identical data: a rung is a
``pdmask compare`` of its own, so the modes of a rung are paired by seed. A **cell** is
one (rung, mode, seed) training run, in ``OUT/<rung>/<mode>-s<seed>/``.

The ladder is described by a YAML spec (``configs/ladder.yaml``)::

    name: ladder
    config: main                     # base preset (a path, or a name in the spec's directory)
    modes: [none, grpo, dppo-topk-kl, pdm-topk-kl]
    seeds: 8                         # RL seeds seed0 .. seed0 + seeds - 1
    reference: dppo-topk-kl          # paired differences are taken against this mode
    collapse_drop: 0.15              # a run collapsed if its worst drop >= this (or it ends below step 0)
    set: {}                          # overrides for every run of the ladder
    mode_set: {drpo: {delta_low: 0.1, delta_high: 0.1}}   # overrides for one mode's runs (its own scale)
    # a label MODE@VARIANT runs MODE again with its own mode_set (e.g. dppo-topk-kl@old: {anchor: old})
    rungs:
      - {name: fp32, label: fp32, set: {engine_precision: fp32}}
      - {name: fp8-sync8, set: {engine_precision: fp8-bf16, sync_every: 8}, extra_modes: [pdm-batch-topk-kl]}
      - {name: v4096-fp8-sync8, family: v4096, config: vocab4096, set: {...}}

Resumability is per cell and needs no flag: a cell whose run finished (``summary.json``
and every step logged) is skipped, a cell with a partial run is resumed from its latest
checkpoint (``pdmask train --resume``: no step lost or repeated), the rest start fresh.
Adding a mode or seeds to the spec (or ``--modes`` / ``--seeds``) therefore runs only the
new cells. A cell whose stored ``config.yaml`` differs from what the spec now asks for is
refused (one line naming the cell and the keys), never silently mixed. ``--prefix-of DIR``
cuts a grid's steps without rerunning it: a cell not started yet whose cell in the ladder
``DIR`` finished the same config with more steps becomes its first ``steps`` steps
(:mod:`pdmask_lab.prefix`, exact). Every invocation
appends to ``OUT/ladder_log.jsonl`` (which cells ran, fresh or resumed, wall times).

The report (:mod:`pdmask_lab.ladder_report`, which imports this module, not the other
way round) is rebuilt from the finished cells after every ``pdmask ladder`` invocation
(``--report-only`` rebuilds it without running anything).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdmask.train.config import TrainConfig, config_diff, is_config_key, load_config, replace, stored_config
from pdmask.train.loss_spec import loss_path

#: The ladder's own record in OUT: every invocation and cell, fresh or resumed, with its wall time.
LADDER_LOG = "ladder_log.jsonl"

_SPEC_KEYS = ("name", "config", "modes", "seeds", "seed0", "reference", "collapse_drop", "set", "mode_set", "rungs",
              "out")
_RUNG_KEYS = ("name", "label", "family", "config", "set", "extra_modes")


@dataclass(frozen=True)
class Rung:
    name: str  #: directory name under OUT
    label: str  #: human label for tables and plots
    family: str  #: rungs of one family form one curve per mode in the plot
    config: Path  #: preset the rung's runs start from
    set: dict  #: the rung's overrides (applied last)
    extra_modes: tuple[str, ...] = ()  #: modes run on this rung only, after the spec's modes


@dataclass
class LadderSpec:
    name: str
    path: Path | None
    modes: list[str]
    seeds: int
    seed0: int
    reference: str
    collapse_drop: float
    set: dict
    rungs: list[Rung]
    out: str = "runs/ladder"
    cli_set: dict = field(default_factory=dict)  #: command-line overrides (every run)
    #: per-mode overrides, applied last (a mode whose threshold is on another scale than the
    #: others', e.g. DRPO's |pi_k - mu_k| next to the top-K KL's delta)
    mode_set: dict = field(default_factory=dict)

    def rung(self, name: str) -> Rung:
        for r in self.rungs:
            if r.name == name:
                return r
        raise ValueError(f"rungs: unknown rung {name!r}; the spec's rungs are: {', '.join(r.name for r in self.rungs)}")

    def modes_of(self, rung: Rung) -> list[str]:
        return self.modes + [m for m in rung.extra_modes if m not in self.modes]


@dataclass(frozen=True)
class Cell:
    rung: Rung
    mode: str
    seed: int
    cfg: TrainConfig

    @property
    def key(self) -> str:
        return f"{self.rung.name}/{self.cfg.run_name}"


# ------------------------------------------------------------------ the spec
def _resolve(name: str | Path, base_dir: Path | None, what: str) -> Path:
    p = Path(name)
    cands = [p] if p.is_absolute() else [p, *([base_dir / p, base_dir / f"{p}.yaml"] if base_dir else []),
                                          Path("configs") / f"{p}.yaml",
                                          Path(__file__).resolve().parents[3] / "configs" / f"{p}.yaml"]
    for c in cands:
        if c.is_file():
            return c
    raise ValueError(f"{what}: config file {str(name)!r} not found")


def _modes_list(v, where: str) -> list[str]:
    from pdmask import MODES
    from pdmask._validate import check_choice

    if isinstance(v, str):
        v = [m.strip() for m in v.split(",") if m.strip()]
    if not isinstance(v, list) or not all(isinstance(m, str) for m in v):
        raise ValueError(f"{where}: expected a list of mode names, got {v!r}")
    for m in v:
        base, _, variant = m.partition("@")
        check_choice(where, base, tuple(MODES))
        if "@" in m and not variant.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"{where}: {m!r}: a mode label is MODE@VARIANT, VARIANT letters, digits, - or _ "
                             "(its settings go in mode_set)")
    if len(set(v)) != len(v):
        raise ValueError(f"{where}: a mode is listed twice ({', '.join(v)})")
    return list(v)


def _overrides(v, where: str) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ValueError(f"{where}: expected a mapping of config key: value, got {v!r}")
    for k in v:
        if not is_config_key(k):
            raise ValueError(f"{where}: unknown config key {k!r}")
        if canonical_key(k) in ("loss.mode", "seed", "name", "out_dir"):
            raise ValueError(f"{where}: {k!r} is set by the ladder for each cell; remove it")
    return dict(v)


def canonical_key(key: str) -> str:
    """A config key in one spelling: a loss field as ``loss.<path>`` (``is_cap`` ->
    ``loss.corrections.is_cap``), any other key as it is."""
    path = loss_path(key)
    return key if path is None else f"loss.{path}"


def _check_seed_count(n_seeds: int, seed0) -> None:
    """At most MAX_SEEDS seeds, the last one a 32-bit seed (:mod:`pdmask.train.config`)."""
    from pdmask.train.config import MAX_SEEDS, SEED_MAX

    if n_seeds > MAX_SEEDS:
        raise ValueError(f"seeds: must be at most {MAX_SEEDS} per mode (each is a training run), got {n_seeds}")
    if isinstance(seed0, int) and not isinstance(seed0, bool) and not 0 <= seed0 <= SEED_MAX - n_seeds + 1:
        raise ValueError(f"seed0: the seeds seed0 .. seed0 + seeds - 1 must lie in [0, {SEED_MAX}], got seed0 "
                         f"{seed0} with {n_seeds} seeds")


def load_spec(path: str | Path, *, modes: list[str] | str | None = None, seeds: int | None = None,
              overrides: list[str] | None = None) -> LadderSpec:
    """Read and check a ladder spec; ``modes`` / ``seeds`` replace the spec's, ``overrides``
    (``key=value``) apply to every run (refused for a key a rung sets: that would erase the rung)."""
    import yaml

    from pdmask.train.config import parse_override

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"spec: file {str(path)!r} not found")
    d = yaml.safe_load(p.read_text()) or {}
    if not isinstance(d, dict):
        raise ValueError(f"spec: {path} must hold a mapping")
    for k in d:
        if k not in _SPEC_KEYS:
            raise ValueError(f"spec: unknown key {k!r} in {path}; valid keys are: {', '.join(_SPEC_KEYS)}")
    for k in ("config", "modes", "rungs"):
        if k not in d:
            raise ValueError(f"spec: {path} has no {k!r}")
    base = _resolve(d["config"], p.parent, "config")
    if not isinstance(d["rungs"], list) or not d["rungs"]:
        raise ValueError("rungs: expected a non-empty list of rungs")
    rungs, names = [], set()
    for i, r in enumerate(d["rungs"]):
        where = f"rungs[{i}]"
        if not isinstance(r, dict) or "name" not in r:
            raise ValueError(f"{where}: expected a mapping with a 'name'")
        for k in r:
            if k not in _RUNG_KEYS:
                raise ValueError(f"{where}: unknown key {k!r}; valid keys are: {', '.join(_RUNG_KEYS)}")
        name = str(r["name"])
        if name in names or not name or "/" in name or name.startswith("."):
            raise ValueError(f"{where}.name: {name!r} is empty, repeated or not a plain directory name")
        names.add(name)
        rungs.append(Rung(name, str(r.get("label", name)), str(r.get("family", "main")),
                          _resolve(r["config"], p.parent, f"{where}.config") if r.get("config") else base,
                          _overrides(r.get("set"), f"{where}.set"),
                          tuple(_modes_list(r.get("extra_modes", []), f"{where}.extra_modes"))))
    n_seeds = int(seeds if seeds is not None else d.get("seeds", 8))
    if n_seeds < 1:
        raise ValueError(f"seeds: must be >= 1, got {n_seeds}")
    _check_seed_count(n_seeds, d.get("seed0", 0))  # before one config per cell is planned
    cli = dict(parse_override(o) for o in (overrides or []))
    _overrides(cli, "overrides")
    mode_set = d.get("mode_set") or {}
    if not isinstance(mode_set, dict):
        raise ValueError(f"mode_set: expected a mapping of mode: {{config key: value}}, got {mode_set!r}")
    mode_set = {m: _overrides(v, f"mode_set.{m}") for m, v in mode_set.items()}
    known = {m for r in rungs for m in r.extra_modes} | set(_modes_list(d["modes"], "modes"))
    for m in mode_set:
        if m not in known:
            raise ValueError(f"mode_set: {m!r} is not a mode of this ladder; its modes are: {', '.join(sorted(known))}")
    for k in cli:
        setters = [r.name for r in rungs if canonical_key(k) in {canonical_key(x) for x in r.set}]
        setters += [f"mode_set.{m}" for m, v in mode_set.items() if canonical_key(k) in {canonical_key(x) for x in v}]
        if setters:
            raise ValueError(f"{k}: set by the ladder's rungs ({', '.join(setters)}); change it in the spec, "
                             f"not on the command line")
    spec = LadderSpec(
        name=str(d.get("name", p.stem)), path=p,
        modes=_modes_list(modes if modes is not None else d["modes"], "modes"),
        seeds=n_seeds, seed0=int(d.get("seed0", 0)), reference=str(d.get("reference", "dppo-topk-kl")),
        collapse_drop=float(d.get("collapse_drop", 0.15)), set=_overrides(d.get("set"), "set"),
        rungs=rungs, out=str(d.get("out", f"runs/{p.stem}")), cli_set=cli, mode_set=mode_set)
    if not 0 < spec.collapse_drop <= 1:
        raise ValueError(f"collapse_drop: must lie in (0, 1], got {spec.collapse_drop}")
    plan_cells(spec, Path(spec.out))  # every cell's config validates now, before anything runs
    return spec


# ------------------------------------------------------------------ cells
def mode_of(label: str) -> str:
    """The mode of a cell's label: a registered mode name, or ``MODE@VARIANT`` (the same mode
    run with other settings, e.g. ``dppo-topk-kl@old`` with ``anchor: old`` in ``mode_set``)."""
    return label.partition("@")[0]


def cell_config(spec: LadderSpec, rung: Rung, mode: str, seed: int, out: Path) -> TrainConfig:
    """The run config of one cell: rung preset < spec ``set`` < command line < rung ``set`` <
    the spec's ``mode_set`` of the cell's mode."""
    values = [*spec.set.items(), *spec.cli_set.items(), *rung.set.items(),  # later wins, whatever the spelling
              *spec.mode_set.get(mode, {}).items()]
    try:
        cfg = load_config(rung.config, values)
        return replace(cfg, {"loss.mode": mode_of(mode)}, seed=seed, name=f"{mode}-s{seed}", out_dir=str(out / rung.name),
                       progress=False)
    except ValueError as e:
        raise ValueError(f"rung {rung.name}: {e}") from None


def plan_cells(spec: LadderSpec, out: Path, rungs: list[str] | None = None) -> list[Cell]:
    """Every (rung, mode, seed) of the spec, ordered rung by rung, seed by seed, then by
    mode: a ladder stopped part-way has whole seeds (all modes) of its first rungs."""
    chosen = [spec.rung(n) for n in rungs] if rungs else spec.rungs
    out = Path(out)
    return [Cell(r, m, s, cell_config(spec, r, m, s, out))
            for r in chosen for s in range(spec.seed0, spec.seed0 + spec.seeds) for m in spec.modes_of(r)]


def cell_status(cell: Cell) -> str:
    """``done`` (finished run of this config), ``partial`` (a run to resume) or ``todo``.

    Raises ValueError when the cell's directory holds a run made with other settings."""
    from pdmask.train.logging import read_jsonl

    d = cell.cfg.run_dir
    try:
        stored = stored_config(d)
    except ValueError as e:  # names the damaged file
        raise ValueError(f"out: cell {cell.key}: {e}; repair it, or delete {d} to rerun the cell") from None
    if stored is None and not (d / "metrics.jsonl").exists():
        return "todo"
    if stored is not None:
        diff = config_diff(stored, cell.cfg)
        if diff:
            shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(diff.items())[:4])
            raise ValueError(f"out: cell {cell.key} holds a run made with other settings ({shown}); "
                             f"use another --out, or delete {d} to rerun it")
    try:
        recs = read_jsonl(d / "metrics.jsonl")
    except ValueError as e:
        raise ValueError(f"out: cell {cell.key}: {e}; repair it, or delete {d} to rerun the cell") from None
    last = max((r.get("step", 0) for r in recs), default=-1)
    if (d / "summary.json").exists() and last == cell.cfg.steps:
        return "done"
    return "partial"


def statuses(cells: list[Cell]) -> dict[str, str]:
    return {c.key: cell_status(c) for c in cells}


# ------------------------------------------------------------------ running
class _Lock:
    """``OUT/.ladder.lock``: one ladder invocation per output directory at a time."""

    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.f = open(out / ".ladder.lock", "w")
        try:
            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.f.close()
            raise ValueError(f"out: another pdmask ladder is running in {out}") from None

    def close(self):
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


def _log_event(out: Path, **rec) -> None:
    with open(out / LADDER_LOG, "a") as f:
        f.write(json.dumps({"time": time.time(), **rec}) + "\n")


class CellFailed(RuntimeError):
    """A cell's ``pdmask train`` subprocess exited non-zero; the message is one line: the
    cell, its exit code, the last line its log holds (the child's own ``error: ...`` line for
    a user error such as a full disk, else the end of its traceback) and the log's path.
    The other cells stop and resume at the next invocation."""

    def __init__(self, key: str, code: int, log: Path):
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()] \
            if log.is_file() else []
        last = lines[-1] if lines else "(no output)"
        super().__init__(f"cell {key} failed (exit {code}): {last} (log: {log})")


def _die_with_parent():  # Linux: a killed ladder takes its training subprocesses with it
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run_cells(todo: list[tuple[Cell, str]], jobs: int, out: Path, console, drop: bool = False) -> None:
    """Run cells (``(cell, "todo" | "partial")``): in this process when ``jobs == 1``,
    else as ``pdmask train`` subprocesses, ``jobs`` at a time, each logging to
    ``OUT/<rung>/<run>.log``, with one live display of each running cell's step, last reward
    and ETA (:mod:`pdmask_lab.live`). ``drop``: a cell's checkpoints are deleted once it has
    finished."""
    import yaml

    from pdmask.train.checkpoint import drop_checkpoints
    from .live import RunsProgress

    if jobs == 1:
        from pdmask.train.grpo import train

        for c, st in todo:
            t = time.time()
            console.print(f"{'resuming' if st == 'partial' else 'starting'} {c.key}")
            train(c.cfg, resume=st == "partial", console=console)
            if drop:
                drop_checkpoints(c.cfg.run_dir)
            _log_event(out, event="cell", cell=c.key, how="resume" if st == "partial" else "fresh",
                       wall_s=time.time() - t)
        return
    cdir = out / ".configs"
    pending = list(todo)
    live: list[tuple[subprocess.Popen, Cell, str, float, object]] = []
    prog = RunsProgress(console, len(todo)).__enter__()
    try:
        while pending or live:
            while pending and len(live) < jobs:
                c, st = pending.pop(0)
                p = cdir / c.rung.name / f"{c.cfg.run_name}.yaml"
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(yaml.safe_dump(c.cfg.to_dict(), sort_keys=False))
                cmd = [sys.executable, "-m", "pdmask.cli", "train", "--config", str(p)]
                cmd += ["--resume"] if st == "partial" else []
                (out / c.rung.name).mkdir(parents=True, exist_ok=True)
                log = open(out / c.rung.name / f"{c.cfg.run_name}.log", "a")
                pr = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
                live.append((pr, c, st, time.time(), log))
                prog.started(c.key, c.cfg.run_dir, c.cfg.steps, out / c.rung.name / f"{c.cfg.run_name}.log",
                             how="resuming" if st == "partial" else "starting")
            time.sleep(0.5)
            prog.refresh()
            for item in list(live):
                pr, c, st, t, log = item
                if pr.poll() is None:
                    continue
                live.remove(item)
                log.close()
                if pr.returncode != 0:
                    raise CellFailed(c.key, pr.returncode, out / c.rung.name / f"{c.cfg.run_name}.log")
                if drop:
                    drop_checkpoints(c.cfg.run_dir)
                _log_event(out, event="cell", cell=c.key, how="resume" if st == "partial" else "fresh",
                           wall_s=time.time() - t)
                prog.finished(c.key)
    finally:
        prog.__exit__(None, None, None)
        for pr, *_ in live:  # an error elsewhere: stop the others (they resume next time)
            pr.kill()
            pr.wait()


def take_prefixes(cells: list[Cell], st: dict[str, str], prefix_of: Path, out: Path, console) -> int:
    """Each cell not started yet whose cell in the ladder ``prefix_of`` is a finished longer
    run of the same config becomes that run's first ``steps`` steps
    (:mod:`pdmask_lab.prefix`); a source cell that cannot stand in is named with its
    reason and the cell runs. Returns how many cells were taken."""
    from pdmask.train.portable import relative_to
    from .prefix import PrefixRefused, take_prefix

    n = 0
    for c in cells:
        src = Path(prefix_of) / c.rung.name / c.cfg.run_name
        if st[c.key] != "todo" or not src.exists():
            continue
        try:
            got = take_prefix(src, c.cfg)
        except PrefixRefused as e:
            console.print(f"not taking {c.key}: {e}", markup=False, soft_wrap=True)  # one line, as said
            continue
        _log_event(out, event="prefix", cell=c.key, source=relative_to(src, out), source_steps=got["source_steps"],
                   source_wall_s=got["source_wall_s"])
        n += 1
        console.print(f"took {c.key}: the first {c.cfg.steps} of the {got['source_steps']} steps of {src}",
                      markup=False, soft_wrap=True)
    return n


def run_ladder(spec: LadderSpec, *, out: str | Path | None = None, jobs: int = 1, rungs: list[str] | None = None,
               prefix_of: str | Path | None = None, keep_checkpoints: int | None = None, console=None) -> dict:
    """Run every unfinished cell (of ``rungs``, default all).

    ``keep_checkpoints``: the checkpoints each cell keeps (None: the config's, 2 by default;
    1: the last; 0: none once the cell has finished; a results-neutral key, so finished
    cells stay done).

    ``prefix_of``: another ladder's output directory whose finished longer runs stand in
    for this ladder's cells not started yet (:func:`take_prefixes`), before anything runs.

    Returns ``{"executed": {"fresh": n, "resume": n}, "prefix": n, "status": {cell: status
    before this call}}``. The report is :func:`pdmask_lab.ladder_report.build_report`
    (``pdmask ladder`` calls it after every invocation)."""
    from rich.console import Console

    from pdmask.train.sft import ensure_sft_checkpoint, sft_key

    console = console or Console()
    if jobs < 1:
        raise ValueError(f"jobs: must be >= 1, got {jobs}")
    if keep_checkpoints is not None and (isinstance(keep_checkpoints, bool) or not isinstance(keep_checkpoints, int)
                                         or keep_checkpoints < 0):
        raise ValueError(f"keep_checkpoints: must be an int >= 0 (0: none once a cell has finished), "
                         f"got {keep_checkpoints!r}")
    out = Path(out or spec.out)
    lock = _Lock(out)
    try:
        cells = plan_cells(spec, out, rungs)
        if keep_checkpoints is not None:
            cells = [Cell(c.rung, c.mode, c.seed, replace(c.cfg, keep_checkpoints=max(keep_checkpoints, 1)))
                     for c in cells]
        st = statuses(cells)
        if prefix_of is not None:
            if not Path(prefix_of).is_dir():
                raise ValueError(f"prefix_of: directory {prefix_of} not found")
            if Path(prefix_of).resolve() == out.resolve():
                raise ValueError(f"prefix_of: {prefix_of} is this ladder's own output directory")
        taken = take_prefixes(cells, st, prefix_of, out, console) if prefix_of is not None else 0
        st_run = statuses(cells) if taken else st
        todo = [(c, st_run[c.key]) for c in cells if st_run[c.key] != "done"]
        counts = {k: sum(v == k for v in st_run.values()) for k in ("done", "partial", "todo")}
        console.print(f"ladder {spec.name}: {len(cells)} cells in {len({c.rung.name for c in cells})} rungs: "
                      f"{counts['done']} done, {counts['partial']} to resume, {counts['todo']} to start ({out})")
        keep = cells[0].cfg.keep_checkpoints if cells else 0
        what = "none once it has finished" if keep_checkpoints == 0 else "the last" if keep == 1 else f"the last {keep}"
        console.print(f"each cell's records in {out}/<rung>/<run>/, its checkpoints in {out}/<rung>/<run>/checkpoints/ "
                      f"({what}; --keep-checkpoints N), its console log in {out}/<rung>/<run>.log with --jobs > 1",
                      markup=False, soft_wrap=True)
        executed = {"fresh": 0, "resume": 0}
        if todo:
            t0 = time.time()
            _log_event(out, event="start", pid=os.getpid(), rungs=rungs or [r.name for r in spec.rungs], jobs=jobs,
                       **counts)
            seen = set()
            for c, _ in todo:  # each SFT base once, before any run (the runs then hit the cache)
                if sft_key(c.cfg) not in seen:
                    seen.add(sft_key(c.cfg))
                    ensure_sft_checkpoint(c.cfg, console=console)
            _run_cells(todo, jobs, out, console, drop=keep_checkpoints == 0)
            executed = {"fresh": sum(s == "todo" for _, s in todo), "resume": sum(s == "partial" for _, s in todo)}
            _log_event(out, event="end", wall_s=time.time() - t0, executed=executed)
        return {"executed": executed, "prefix": taken, "status": st}
    finally:
        lock.close()
