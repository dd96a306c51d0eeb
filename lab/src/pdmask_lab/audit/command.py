"""What ``pdmask audit`` does (:func:`run_cli`): settings, seeds, workers, the report.

Resumable per seed: each finished seed is written to ``OUT/seeds/seed-NNNNNN.safetensors``
(atomically; no pickles: the records as tensors, the rest as JSON in the file's metadata)
next to ``OUT/seeds/settings.json``; a rerun with the same settings skips
the seeds already there (``fresh=True`` starts over), a rerun with other settings is
refused. ``jobs = N`` runs the seeds in N worker processes (``threads`` torch threads
each) and writes the report when all are done; each worker logs to
``OUT/seeds/worker-<i>.log``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pdmask.train.portable import portable_command, portable_config, portable_path
from .config import FIDELITY_KS_ARG

#: trainer settings that do not change a seed's numbers (left out of the resume fingerprint)
_NEUTRAL_TRAIN_KEYS = ("progress", "threads", "out_dir", "name", "tensorboard", "eval_every", "checkpoint_every",
                       "keep_checkpoints", "steps", "loss.validate")
#: audit settings that change only the summary, not a seed's records
_NEUTRAL_AUDIT_KEYS = ("bootstrap", "bootstrap_seed", "delta_sweep")


def _configs(a: dict):
    """(trainer config, audit config) from the command's arguments; every check made here."""
    from pdmask.train.checkpoint import is_run_dir
    from pdmask.train.config import load_config
    from .config import AuditConfig, audit_loss

    if a["seeds"] < 1:
        raise ValueError(f"seeds: must be >= 1, got {a['seeds']}")
    if a["jobs"] < 1:
        raise ValueError(f"jobs: must be >= 1, got {a['jobs']}")
    over = list(a["set_"])
    if a["model"] and not is_run_dir(a["model"]):
        # the model is the trainer config's model (no SFT on top): its checks (a model directory
        # or an installed named source, a chat template when asked for) run before any work
        over = [f"model_path={a['model']}", "sft_steps=0", *over]
    for key, val in (("engine_precision", a["precision"]), ("temperature", a["temperature"]), ("top_k", a["top_k"])):
        if val is not None:
            over.append(f"{key}={val}")
    over.append(f"progress={'true' if a['progress'] else 'false'}")
    config = a["config"]
    if config is None and a["model"] and is_run_dir(a["model"]):
        config = Path(a["model"]) / "config.yaml"  # the run's own model/task/engine/loss settings
    tcfg = load_config(config, over)
    if tcfg.loss_from != "logits":
        raise ValueError("loss_from: the audit's steps and oracle read the logits; loss_from=hidden is not available "
                         "in the audit (the numbers are the same up to rounding); use loss_from=logits")
    # the trainer's whole loss spec, with the audit's step mode, headline estimator and O's deltas
    # (each side: --delta-low / --delta-high, else --delta, else the trainer's, else the divergence's)
    deltas = tuple(a.get(k) if a.get(k) is not None else a["delta"] for k in ("delta_low", "delta_high"))
    loss = audit_loss(tcfg.loss_fields, step_mode=a["step_mode"], estimator=a["estimator"], deltas=deltas,
                      divergence=a["divergence"])
    cfg = AuditConfig(
        divergence=a["divergence"], estimator=a["estimator"], loss=loss, optimizer=a["optimizer"],
        lr=tcfg.lr if a["lr"] is None else a["lr"], weight_decay=tcfg.weight_decay, grad_clip=tcfg.grad_clip,
        sample_tokens=a["sample_tokens"], disagreement_tokens=a["disagreement_tokens"],
        instruments=tuple(x.strip() for x in a["instruments"].split(",") if x.strip()),
        isolated_step=a["isolated_step"], logit_step=a["logit_step"], tie_tol=a["tie_tol"], bootstrap=a["bootstrap"],
        delta_sweep=_floats("delta_sweep", a.get("delta_sweep", "")),
        fidelity_ks=_ints("fidelity_ks", a.get("fidelity_ks", FIDELITY_KS_ARG)),
    )
    return tcfg, cfg


def _floats(name: str, text: str) -> tuple:
    try:
        return tuple(float(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated numbers, got {text!r}") from None


def _ints(name: str, text: str) -> tuple:
    vals = _floats(name, text)
    if not vals or any(not v.is_integer() or v < 1 for v in vals):
        raise ValueError(f"{name}: expected comma-separated positive integers, got {text!r}")
    return tuple(int(v) for v in vals)


def _fingerprint(a: dict, tcfg, cfg) -> dict:
    """What decides a seed's numbers: the audit's settings and the trainer's, the latter as
    :func:`pdmask.train.config.comparable` puts them (the loss as the fields it resolves to)."""
    from pdmask.train.config import comparable

    t = {k: v for k, v in comparable(portable_config(tcfg.to_dict())).items() if k not in _NEUTRAL_TRAIN_KEYS}
    c = {k: v for k, v in cfg.to_dict().items() if k not in _NEUTRAL_AUDIT_KEYS}
    return _json({"audit": c, "trainer": t, "model": portable_path(str(a["model"])), "lag": a["lag"]})


def _json(x):
    return json.loads(json.dumps(x, default=str))


def _seed_dir(out: Path, fp: dict, fresh: bool) -> Path:
    d = Path(out) / "seeds"
    if fresh and d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True, exist_ok=True)
    f = d / "settings.json"
    if f.exists():
        old = _with_new_defaults(json.loads(f.read_text()), fp)
        if old == fp:
            f.write_text(json.dumps(fp, indent=1))  # now in the current code's terms
        else:
            diff = [f"{sec}.{k}" for sec in fp
                    for k in (sorted(set(fp[sec]) | set(old.get(sec) or {})) if isinstance(fp[sec], dict) else [None])
                    if (old.get(sec, {}).get(k) if k else old.get(sec)) != (fp[sec].get(k) if k else fp[sec])]
            raise ValueError(f"out: {str(out)!r} holds seeds audited with other settings ({', '.join(diff[:5])} "
                             "differ); use another --out or pass --fresh")
    else:
        f.write_text(json.dumps(fp, indent=1))
    return d


def _with_new_defaults(old: dict, fp: dict) -> dict:
    """``old`` (a ``settings.json`` of any version) in the current fingerprint's terms.

    The trainer section as :func:`pdmask.train.config.comparable` puts it (the short names
    of the flat config in the loss, the loss as what it resolves to: a stored ``is_cap: 5``
    and a null one are the same), with the settings it does not know (fields added to the
    trainer config since its seeds were written) at their defaults: a seed written before a
    new field existed was computed as with the field's default; a new field at a
    non-default value stays a difference. An audit section of the flat version (its
    ``step_mode``, ``delta_low``, ``is_cap``, ... beside the optimizer's) becomes the loss
    spec those settings made: the batch step then built only ``Corrections(is_cap)`` and
    ``Sampling(temperature)``, every other loss field at its default."""
    from pdmask.train.config import TrainConfig, comparable

    defaults = _json(comparable(TrainConfig().to_dict()))
    t = {k: v for k, v in _json(comparable(old.get("trainer", {}))).items() if k not in _NEUTRAL_TRAIN_KEYS}
    for k in fp.get("trainer", {}):
        if k not in t and k in defaults:
            t[k] = defaults[k]
    audit = old.get("audit", {})
    if "loss" not in audit and "step_mode" in audit:
        audit = _audit_of_flat(audit)
    return {**old, "trainer": t, "audit": audit}


def _audit_of_flat(old: dict) -> dict:
    """An audit section written before ``AuditConfig.loss`` (see :func:`_with_new_defaults`)."""
    from pdmask.train.config import stored_loss
    from pdmask.train.loss_spec import LOSS_ALIASES, build_loss, loss_fields, resolved_fields
    from .config import _finite

    given = {k: v for k, v in old.items() if k in LOSS_ALIASES}
    given["mode"] = old.get("step_mode", "none")
    fields = loss_fields(stored_loss(given))
    fields["validate"] = True
    rest = {k: v for k, v in old.items() if k not in LOSS_ALIASES and k != "step_mode"}
    return _json({**rest, "estimator": old.get("estimator", "exact"),
                  "loss": _finite(resolved_fields(build_loss(fields)[0]))})


def check_not_empty(results) -> None:
    """Refuse to write tables with nothing in them as if they were results: no token with
    A != 0 in any seed (every group flat), or no token out of the region."""
    n = len(results)
    active = sum(r.info["n_active_tokens"] for r in results)
    if active == 0:
        rewards = sorted({round(r.info.get("reward_mean", float("nan")), 3) for r in results})
        raise ValueError(f"audit: 0 tokens with A != 0 in {n} seeds (every group's rewards are equal; mean reward "
                         f"per seed {rewards}): the task or reward gives this model no signal, so there is "
                         "nothing to audit and no tables were written (pick a task the model solves sometimes)")
    out = sum(r.info["n_out_of_region"] for r in results)
    if out == 0:
        raise ValueError(f"audit: 0 of {active} tokens with A != 0 are out of the region in {n} seeds: the tables "
                         "would be empty, none were written (lower --delta, add --lag or a coarser --precision)")


#: the ``format`` in every seed file's safetensors metadata
SEED_FORMAT = "pdmask-audit-seed/1"


def seed_path(d: Path, seed: int) -> Path:
    return d / f"seed-{seed:06d}.safetensors"


def _old_seed_path(d: Path, seed: int) -> Path:
    return d / f"seed-{seed:06d}.pt"  # the pickle format of earlier versions: never loaded


def pending_seeds(d: Path, seeds: list[int], warn=None) -> list[int]:
    """The seeds of ``seeds`` without a seed file in ``d``. A seed whose only file is of the
    old pickle format (``seed-NNNNNN.pt``) is among them: it is recomputed, the old file is
    never unpickled (``warn`` is told which)."""
    todo = [s for s in seeds if not seed_path(d, s).exists()]
    old = [_old_seed_path(d, s).name for s in todo if _old_seed_path(d, s).exists()]
    if old and warn is not None:
        more = f" and {len(old) - 1} more" if len(old) > 1 else ""
        warn(f"audit: {old[0]}{more} in {d} are of the old pickle format: ignored (never unpickled), "
             "their seeds are recomputed")
    return todo


def save_seed(d: Path, r) -> None:
    """One safetensors file per seed: the per-token records as tensors, the rest as JSON in
    its metadata (:func:`pdmask.train.checkpoint.encode_tree`, as in the checkpoints), written
    to a temporary name and renamed, so a seed file is whole or absent."""
    from safetensors.torch import save_file

    from pdmask.train.checkpoint import encode_tree
    from pdmask.train.rundir import writing

    tensors: dict = {}
    tree = encode_tree({"seed": r.seed, "info": r.info, "tokens": r.tokens, "entropy": r.entropy,
                        "fidelity": r.fidelity}, tensors)
    tmp = d / f".seed-{r.seed:06d}.tmp"
    with writing(tmp):
        save_file(tensors, str(tmp), metadata={"format": SEED_FORMAT, "tree": json.dumps(tree)})
    tmp.rename(seed_path(d, r.seed))


def load_seed(path: Path):
    """A seed file written by :func:`save_seed` (nothing is unpickled); an unreadable one is a
    ValueError naming it."""
    from safetensors import safe_open

    from pdmask.train.checkpoint import decode_tree
    from .runner import SeedResult

    def bad(why):
        return ValueError(f"out: {str(path)!r} is not a readable audit seed file ({why}); delete it to "
                          "recompute that seed, or pass --fresh")

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types on a bad header
        raise bad(" ".join(str(e).split()) or type(e).__name__) from None
    if meta.get("format") != SEED_FORMAT:
        raise bad(f"format {meta.get('format')!r}, expected {SEED_FORMAT!r}")
    try:
        x = decode_tree(json.loads(meta["tree"]), tensors)
        return SeedResult(x["seed"], x["info"], x["tokens"], x["entropy"], x["fidelity"])
    except (KeyError, TypeError, ValueError) as e:
        raise bad(f"{type(e).__name__}: {e}") from None


def _audit_seeds(a: dict, tcfg, cfg, d: Path, todo: list[int], console, progress: bool) -> dict:
    """Build the source and audit ``todo`` in this process, saving each seed; returns the source info."""
    from .runner import run_audit
    from .source import build_source

    src = build_source(tcfg, model=a["model"], lag=a["lag"], console=console)
    state = src.optimizer_state if cfg.optimizer != "sgd" else None
    if todo:
        run_audit(src.model, src.forward, src.sample, todo, cfg, progress=progress, optimizer_state=state,
                  console=console, on_seed=lambda r: save_seed(d, r))
    info = dict(src.info)
    info["optimizer_state"] = (src.info.get("optimizer_state", "from the lag steps" if a["lag"] else "fresh")
                               if state is not None else "fresh")
    (d / "source.json").write_text(json.dumps(info, indent=1, default=str))
    return info


def ensure_base(a: dict, tcfg, threads: int, console) -> None:
    """Train (or find) the SFT base once in this process, with ``threads`` threads, before
    parallel workers start (each would otherwise train the same base)."""
    from pdmask.train.checkpoint import is_run_dir
    from pdmask.train.config import replace
    from pdmask.train.sft import ensure_sft_checkpoint

    from pdmask.train.named_models import is_named, resolve_model

    if is_named(a["model"]):  # converted once here, not raced by the workers
        resolve_model(a["model"], cache_dir=tcfg.cache_dir or None, console=console)
    elif not a["model"] or is_run_dir(a["model"]):
        ensure_sft_checkpoint(replace(tcfg, threads=max(threads, tcfg.threads)), console=console)


def _worker(args_path: str, shard: int, n_shards: int) -> None:
    """One of ``--jobs`` processes: the seeds ``todo[shard::n_shards]``."""
    from rich.console import Console

    a = json.loads(Path(args_path).read_text())
    a["config"] = Path(a["config"]) if a["config"] else None
    tcfg, cfg = _configs(a)
    d = Path(a["out"]) / "seeds"
    todo = [s for s in a["_todo"][shard::n_shards]]
    _audit_seeds(a, tcfg, cfg, d, todo, Console(stderr=True), progress=False)


def _run_workers(a: dict, d: Path, todo: list[int], jobs: int, console) -> None:
    args = {**a, "out": str(a["out"]), "config": str(a["config"]) if a["config"] else None, "_todo": todo}
    (d / "worker-args.json").write_text(json.dumps(args, default=str))
    procs = []
    for i in range(jobs):
        log = open(d / f"worker-{i}.log", "w")
        cmd = [sys.executable, "-c", f"from pdmask_lab.audit.command import _worker; _worker({str(d / 'worker-args.json')!r}, {i}, {jobs})"]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log, i))
    total, done0 = len(todo), lambda: sum(seed_path(d, s).exists() for s in todo)
    console.print(f"audit: {total} seeds in {jobs} workers (logs: {d}/worker-*.log)", soft_wrap=True)
    last, shown = -1, 0.0
    while any(p.poll() is None for p, _, _ in procs):
        n = done0()
        if n != last and time.time() - shown >= 30:  # a line at most every 30 s
            console.print(f"audit: {n}/{total} seeds done", soft_wrap=True)
            last, shown = n, time.time()
        time.sleep(2)
    for p, log, i in procs:
        log.close()
        if p.returncode != 0:
            tail = (d / f"worker-{i}.log").read_text()[-2000:]
            raise ValueError(f"jobs: worker {i} failed (exit {p.returncode}); the seeds done so far are kept, rerun "
                             f"to resume. Its log ends with:\n{tail}")


def run_cli(*, out, model, config, set_, seeds, seed_offset, precision, temperature, top_k, lag, divergence,
            delta, estimator, step_mode, optimizer, lr, sample_tokens, disagreement_tokens,
            instruments, isolated_step, logit_step, tie_tol, bootstrap, jobs, fresh, plots, progress,
            delta_sweep="", fidelity_ks=FIDELITY_KS_ARG, delta_low=None, delta_high=None) -> dict:
    a = dict(locals())  # the arguments (first: nothing else is local yet)
    from rich.console import Console

    from .report import headline, write_report
    from .runner import summarize_all

    tcfg, cfg = _configs(a)
    console = Console(stderr=True)
    t0 = time.time()
    d = _seed_dir(Path(out), _fingerprint(a, tcfg, cfg), fresh)
    all_seeds = list(range(seed_offset, seed_offset + seeds))
    todo = pending_seeds(d, all_seeds, warn=lambda m: console.print(m, soft_wrap=True))
    if len(todo) < len(all_seeds):
        console.print(f"audit: resuming, {len(all_seeds) - len(todo)} of {len(all_seeds)} seeds already in {d}")
    if jobs > 1 and len(todo) > 1:
        ensure_base(a, tcfg, jobs, console)
        _run_workers(a, d, todo, min(jobs, len(todo)), console)
        info = json.loads((d / "source.json").read_text())
    elif todo or not (d / "source.json").exists():
        info = _audit_seeds(a, tcfg, cfg, d, todo, console, progress)
    else:
        info = json.loads((d / "source.json").read_text())
    results = [load_seed(seed_path(d, s)) for s in all_seeds]
    check_not_empty(results)
    summary = summarize_all(results, cfg)
    run = {"command": portable_command("pdmask", sys.argv[1:]),
           "seeds": f"{seed_offset}..{seed_offset + seeds - 1}", "jobs": jobs, **info,
           "trainer_config": portable_config(tcfg.to_dict()), "wall_s": round(time.time() - t0, 1)}
    doc = write_report(out, results, summary, cfg, run_settings=run, plots=plots, runtime_s=round(time.time() - t0, 1))
    console.print(f"audit: wrote {Path(out) / 'audit.md'} ({seeds} seeds, {time.time() - t0:.0f} s)")
    for line in headline(doc):  # the result, on stdout (progress and messages went to stderr)
        Console(soft_wrap=True).print(line, markup=False, highlight=False)
    return doc
