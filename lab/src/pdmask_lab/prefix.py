"""A finished longer run's first N steps, taken as the finished N-step run
(``pdmask ladder --prefix-of DIR``): cutting a grid's steps without rerunning the cells
that already ran longer.

Why this is exact, not an approximation. In :func:`pdmask.train.grpo.train` nothing
before step N reads the total ``steps``: the prompts of a step and its sampling seed are
functions of (seed, step) (:func:`~pdmask.train.grpo.step_prompts`,
:func:`~pdmask.train.grpo.rollout_seed`), the RL learning rate is constant, and
``steps`` only bounds the loop and adds a held-out evaluation and a checkpoint at the
last step. So a run of S > N steps whose records hold a held-out evaluation at step N
(``eval_every`` divides N) has, up to step N, the records an N-step run of the same
config would write; ``tests/train/test_prefix.py`` checks this on the smoke preset, record
for record. The summary is recomputed from those records by the trainer's own
:func:`~pdmask.train.grpo.summarize`.

What the prefix cell lacks: checkpoints (it cannot be resumed or extended; delete it and
run it to get them) and tensorboard events. Its ``summary.json`` says where it came from
(``prefix_of``), and the ladder logs it as a ``prefix`` event with the source's machine
time for those N steps (the report counts it apart from the cells this ladder ran).

Naive equivalent::

    recs = [r for r in read_jsonl(src / "metrics.jsonl") if r["step"] <= N]
    write(dst / "metrics.jsonl", recs); write(dst / "summary.json", summarize(recs, cfg))
"""

from __future__ import annotations

import json
from pathlib import Path

from pdmask.train.config import TrainConfig, config_diff, stored_config
from pdmask.train.portable import relative_to

#: the key of a prefix cell's summary.json naming its source run
PREFIX_KEY = "prefix_of"


def _finished_records(src: Path) -> tuple[dict, list[dict], dict] | str:
    """(stored config, metrics records, summary) of a finished run in ``src``, or why not."""
    from pdmask.train.logging import read_jsonl

    try:  # a damaged file of the source is a reason not to take it (named), not an error of this ladder
        stored = stored_config(src)
        if stored is None or not (src / "summary.json").is_file():
            return f"{src} holds no finished run (config.yaml and summary.json)"
        recs = read_jsonl(src / "metrics.jsonl")
    except (ValueError, OSError) as e:
        return _damaged(e)
    last = max((r.get("step", 0) for r in recs), default=-1)
    if last != stored.get("steps"):
        return f"{src} is not finished (last step {last} of {stored.get('steps')})"
    f = src / "summary.json"
    try:
        summary = json.loads(f.read_text())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return _damaged(e, f) if isinstance(e, OSError) else f"{f}: not valid JSON ({e})"
    if not isinstance(summary, dict):
        return f"{f}: holds a {type(summary).__name__}, not a JSON object"
    if summary.get(PREFIX_KEY):
        of = summary[PREFIX_KEY]
        return f"{src} is itself a prefix cell (of {of.get('run') if isinstance(of, dict) else of}); use its source"
    return stored, recs, summary


def _damaged(e: OSError | ValueError, path: Path | None = None) -> str:
    """A read error as one line naming the file (``path`` when an OSError carries no name;
    the ValueErrors of :func:`stored_config` and :func:`read_jsonl` name theirs)."""
    if isinstance(e, OSError):
        return f"{e.filename or path}: cannot read ({e.strerror or e})"
    return str(e)


class PrefixRefused(ValueError):
    """The source run cannot stand in for the cell (the message says why, naming the source)."""


def _source(src: Path, cfg: TrainConfig) -> tuple[dict, list[dict], dict] | str:
    """(stored config, records, summary) of the run in ``src`` when it can stand in for the
    ``cfg`` run, else why not."""
    got = _finished_records(src)
    if isinstance(got, str):
        return got
    stored, recs, _ = got
    diff = config_diff(stored, cfg)
    if set(diff) != {"steps"}:
        other = {k: v for k, v in diff.items() if k != "steps"}
        if not other:
            return f"{src} is the same run (steps {cfg.steps}), not a longer one"
        shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(other.items())[:4])
        return f"{src} differs in more than steps ({shown})"
    if diff["steps"][0] < cfg.steps:
        return f"{src} ran {diff['steps'][0]} steps, fewer than {cfg.steps}"
    if not any(r.get("step") == cfg.steps and r.get("eval_accuracy") is not None for r in recs):
        return (f"{src} has no held-out evaluation at step {cfg.steps} (its eval_every {stored.get('eval_every')} "
                f"does not divide {cfg.steps})")
    return got


def take_prefix(src: str | Path, cfg: TrainConfig) -> dict:
    """Write the ``cfg`` run (``cfg.run_dir``: config.yaml, metrics.jsonl, summary.json)
    from the first ``cfg.steps`` steps of the finished longer run in ``src``; returns
    ``{"summary": ..., "source_steps": S, "source_wall_s": the source's wall_s at step N}``.

    Raises :class:`PrefixRefused` (naming ``src``) when the source cannot stand in for this
    run, ValueError when ``cfg.run_dir`` already holds records."""
    import shutil

    from pdmask.train.grpo import _yaml, summarize
    from pdmask.train.logging import read_jsonl, truncate_jsonl
    from pdmask.train.rundir import writing

    src = Path(src)
    got = _source(src, cfg)
    if isinstance(got, str):
        raise PrefixRefused(f"prefix_of: {got}")
    stored, _, src_summary = got
    dst = cfg.run_dir
    if (dst / "metrics.jsonl").exists() or (dst / "config.yaml").exists():
        raise ValueError(f"prefix_of: {dst} already holds a run; a prefix cell is written only where none is")
    dst.mkdir(parents=True, exist_ok=True)
    with writing(dst / "metrics.jsonl"):
        shutil.copyfile(src / "metrics.jsonl", dst / "metrics.jsonl")
    truncate_jsonl(dst / "metrics.jsonl", cfg.steps)
    keep = read_jsonl(dst / "metrics.jsonl")
    summary = summarize(keep, cfg, {"eval_greedy_accuracy": src_summary.get("sft_eval_accuracy")})
    summary["environment"] = src_summary.get("environment")  # the machine that ran these steps
    summary[PREFIX_KEY] = {"run": relative_to(src, dst), "steps": stored["steps"]}  # from this run's directory
    for name, text in (("config.yaml", _yaml(cfg.to_dict())), ("summary.json", json.dumps(summary, indent=2))):
        with writing(dst / name):
            (dst / name).write_text(text)
    return {"summary": summary, "source_steps": stored["steps"], "source_wall_s": keep[-1].get("wall_s")}
