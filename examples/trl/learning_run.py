"""The TRL learning run of docs/trl.md: pdmask's mask against plain TRL GRPO, seed by seed, and its report.

Runs ``examples/trl/train_grpo.py`` for every label x seed (labels: ``pdm-topk-kl``, pdmask's
trainer with that mask; ``plain-trl``, TRL's own unmodified ``GRPOTrainer`` with the same
settings), each into ``RUNS/<label>-s<seed>``, then reports from their records alone::

    # in the TRL environment (docs/trl.md, Install); resumable: finished runs are skipped
    python examples/trl/learning_run.py run --runs runs/trl-learning --seeds 0 1 --jobs 2
    # in the main environment (matplotlib, pdmask-lab's statistics): reads the records, copies
    # them to OUT/records and writes OUT/README.md, OUT/heldout.png, OUT/summary.json
    python examples/trl/learning_run.py report --runs runs/trl-learning --out docs/results/trl-learning

A run's records (written by train_grpo.py into its output directory): ``run.json`` (label,
seed, settings, environment, ``finished``, wall time), ``heldout.jsonl`` (held-out greedy
accuracy per evaluation with per-prompt scores), ``steps.jsonl`` (reward, kept / clipped share
and seconds per step); the driver adds ``grid.json`` (the arguments it ran with: a finished run
is skipped only when they are the same) and ``train.log`` (the run's output).

The report: held-out accuracy per step for each label (mean over seeds and each seed), the
paired difference over seeds of the final accuracy and of the gain (final - step 0) with a
two-sided exact sign-flip test, and McNemar's exact test on the final per-prompt correctness,
pooled over seeds (pairs = prompts x seeds). The statistics are the project's
(``pdmask_lab.significance``, imported when the report is made: the run needs only TRL).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent / "train_grpo.py"
#: label -> the example's arguments that make it
LABELS = {"pdm-topk-kl": ["--mask-mode", "pdm-topk-kl"], "plain-trl": ["--plain-trl"]}
#: the comparison's reference
BASELINE = "plain-trl"
RECORDS = ("run.json", "heldout.jsonl", "steps.jsonl")
#: the report's lines that the console shows while a run goes (train.log keeps everything)
SHOWN = ("step ", "done:", "Traceback", "Error", "error:")


# ------------------------------------------------------------------ running the grid
def example_args(a) -> list[str]:
    """The arguments every run of the grid shares (the label's and the output directory aside)."""
    out = ["--model", a.model, "--max-steps", str(a.max_steps), "--eval-every", str(a.eval_every)]
    if a.eval_prompts is not None:
        out += ["--eval-prompts", str(a.eval_prompts)]
    return out + list(a.extra)


def run_name(label: str, seed: int) -> str:
    return f"{label}-s{seed}"


def finished(run_dir: Path) -> bool:
    p = run_dir / "run.json"
    try:
        return bool(json.loads(p.read_text()).get("finished"))
    except (OSError, ValueError):
        return False


def plan(runs: Path, labels: list[str], seeds: list[int], shared: list[str]) -> list[tuple[str, int, list[str]]]:
    """The runs still to do: ``(label, seed, argv)``; a finished run with the same arguments is
    skipped, one with other arguments is an error (one line naming it), an unfinished one is redone."""
    todo = []
    for seed in seeds:
        for label in labels:
            d = runs / run_name(label, seed)
            argv = [*shared, *LABELS[label], "--seed", str(seed)]
            if finished(d):
                try:
                    had = json.loads((d / "grid.json").read_text())["args"]
                except (OSError, ValueError, KeyError):
                    had = None
                if had != argv:
                    raise ValueError(f"--runs: {d} finished with other arguments ({had}); remove it or pass another "
                                     "--runs")
                continue
            todo.append((label, seed, argv))
    return todo


def launch(python: str, example: Path, run_dir: Path, argv: list[str], threads: int, echo) -> int:
    """One run: the example in a child process, its output in ``train.log``, its step lines echoed."""
    if run_dir.exists():  # an unfinished run starts over
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "grid.json").write_text(json.dumps({"args": argv}, indent=2) + "\n")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    cmd = [python, str(example), *argv, "--output-dir", str(run_dir)]
    with open(run_dir / "train.log", "w") as log, subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as p:
        for line in p.stdout:
            log.write(line)
            if line.startswith(SHOWN) or "Error" in line:
                echo(f"[{run_dir.name}] {line.rstrip()}")
    return p.returncode


def run_grid(a) -> int:
    runs = Path(a.runs)
    try:
        todo = plan(runs, a.labels, a.seeds, example_args(a))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // a.jobs))
    print(f"{len(todo)} run(s) to do in {runs} ({len(a.labels) * len(a.seeds) - len(todo)} finished), "
          f"{a.jobs} at a time, {threads} thread(s) each", flush=True)
    lock = threading.Lock()

    def echo(line: str) -> None:
        with lock:
            print(line, flush=True)

    def one(item) -> tuple[str, int]:
        label, seed, argv = item
        return run_name(label, seed), launch(a.python, Path(a.example), runs / run_name(label, seed), argv, threads,
                                             echo)

    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        results = list(pool.map(one, todo))
    failed = [f"{name} (exit {rc}; see its train.log)" for name, rc in results if rc != 0]
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
        return 1
    print(f"all {len(a.labels) * len(a.seeds)} runs finished; report: python examples/trl/learning_run.py report "
          f"--runs {a.runs}", flush=True)
    return 0


# ------------------------------------------------------------------ reading the records
def read_jsonl(p: Path) -> list[dict]:
    try:
        text = p.read_text()
    except OSError as e:
        raise ValueError(f"{p.name}: cannot read {p} ({e.strerror or e})") from None
    out = []
    for i, ln in enumerate(text.splitlines(), 1):
        if ln.strip():
            try:
                out.append(json.loads(ln))
            except ValueError:
                raise ValueError(f"{p.name}: {p}:{i} is not JSON") from None
    return out


def load_runs(runs: Path) -> list[dict]:
    """Every finished run under ``runs``: ``{"name", "dir", "run", "heldout", "steps"}``."""
    if not runs.is_dir():
        raise ValueError(f"--runs: {runs} is not a directory")
    out = []
    for d in sorted(p for p in runs.iterdir() if (p / "run.json").exists()):
        if not finished(d):
            continue
        run = json.loads((d / "run.json").read_text())
        out.append({"name": d.name, "dir": d, "run": run, "heldout": read_jsonl(d / "heldout.jsonl"),
                    "steps": read_jsonl(d / "steps.jsonl")})
    if not out:
        raise ValueError(f"--runs: no finished run in {runs} (a run is finished when its run.json says so)")
    return out


def copy_records(found: list[dict], dest: Path) -> None:
    """The records the report is built from, beside it (``OUT/records/<run>/``)."""
    for r in found:
        target = dest / r["name"]
        if r["dir"].resolve() == target.resolve():
            continue
        target.mkdir(parents=True, exist_ok=True)
        for f in RECORDS:
            shutil.copyfile(r["dir"] / f, target / f)


def paired_runs(found: list[dict], baseline: str) -> tuple[str, list[int], dict]:
    """``(treatment label, seeds both labels ran, {(label, seed): run})``; exactly two labels,
    the same evaluation steps and prompts in every run, or one ``ValueError`` line."""
    by = {(r["run"]["label"], r["run"]["seed"]): r for r in found}
    labels = sorted({lab for lab, _ in by})
    if baseline not in labels or len(labels) != 2:
        raise ValueError(f"--runs: needs finished runs of {baseline} and one other label, found {labels}")
    treat = next(lab for lab in labels if lab != baseline)
    seeds = sorted(s for lab, s in by if lab == treat and (baseline, s) in by)
    if not seeds:
        raise ValueError(f"--runs: no seed has finished runs of both {treat} and {baseline}")
    ref = by[(baseline, seeds[0])]
    want = ([h["step"] for h in ref["heldout"]], ref["heldout"][0]["n_prompts"])
    for s in seeds:
        for lab in (treat, baseline):
            r = by[(lab, s)]
            have = ([h["step"] for h in r["heldout"]], r["heldout"][0]["n_prompts"] if r["heldout"] else None)
            if have != want:
                raise ValueError(f"heldout.jsonl: {r['name']} evaluated at steps {have[0]} on {have[1]} prompts, "
                                 f"{ref['name']} at {want[0]} on {want[1]}: not comparable")
    return treat, seeds, by


# ------------------------------------------------------------------ the numbers
def curves(by: dict, labels: list[str], seeds: list[int]) -> dict:
    """Held-out accuracy per evaluation step: per label, each seed's curve and their mean."""
    out = {}
    for lab in labels:
        per_seed = {s: [h["accuracy"] for h in by[(lab, s)]["heldout"]] for s in seeds}
        mean = [statistics.fmean(v) for v in zip(*per_seed.values())]
        out[lab] = {"mean": mean, "per_seed": {str(s): v for s, v in per_seed.items()}}
    return out


def mcnemar_counts(by: dict, treat: str, baseline: str, seeds: list[int]) -> dict | None:
    """Final per-prompt correctness, paired by (seed, prompt): ``b`` = only the treatment right,
    ``c`` = only the baseline right, pooled over seeds. None when a score is not 0 or 1."""
    b = c = both = neither = 0
    for s in seeds:
        x, y = by[(treat, s)]["heldout"][-1]["scores"], by[(baseline, s)]["heldout"][-1]["scores"]
        if any(v not in (0.0, 1.0) for v in x + y):
            return None
        for u, v in zip(x, y):
            b += u > v
            c += v > u
            both += u == v == 1.0
            neither += u == v == 0.0
    return {"b": b, "c": c, "both": both, "neither": neither, "n_pairs": b + c + both + neither,
            "n_prompts": len(by[(treat, seeds[0])]["heldout"][-1]["scores"]), "n_seeds": len(seeds)}


def timing(by: dict, labels: list[str], seeds: list[int]) -> dict:
    """Median seconds per step and per evaluation of each run, and each run's wall time."""
    out = {}
    for lab in labels:
        for s in seeds:
            r = by[(lab, s)]
            dts = [x["time_step_s"] for x in r["steps"] if x.get("time_step_s") is not None]
            out[r["name"]] = {"step_s_median": statistics.median(dts) if dts else None,
                              "eval_s_median": statistics.median(h["eval_s"] for h in r["heldout"]),
                              "wall_s": r["run"].get("wall_s"), "steps": len(r["steps"])}
    return out


def summarize(found: list[dict], baseline: str = BASELINE) -> dict:
    """Everything the report states, from the records (``summary.json``)."""
    from pdmask_lab.significance import mcnemar_exact, min_sign_flip_p, paired_difference

    treat, seeds, by = paired_runs(found, baseline)
    labels = [treat, baseline]
    final = {lab: [by[(lab, s)]["heldout"][-1]["accuracy"] for s in seeds] for lab in labels}
    start = {lab: [by[(lab, s)]["heldout"][0]["accuracy"] for s in seeds] for lab in labels}
    gain = {lab: [f - s0 for f, s0 in zip(final[lab], start[lab])] for lab in labels}
    mc = mcnemar_counts(by, treat, baseline, seeds)
    if mc is not None:
        mc["p"] = mcnemar_exact(mc["b"], mc["c"])
    ref = by[(baseline, seeds[0])]
    return {
        "treatment": treat, "baseline": baseline, "seeds": seeds,
        "eval_steps": [h["step"] for h in ref["heldout"]], "n_prompts": ref["heldout"][0]["n_prompts"],
        "accuracy": curves(by, labels, seeds),
        "finished_final": {lab: [by[(lab, s)]["heldout"][-1]["finished"] for s in seeds] for lab in labels},
        "final": final, "gain": gain,
        "paired_final": paired_difference(final[treat], final[baseline]).to_dict(),
        "paired_gain": paired_difference(gain[treat], gain[baseline]).to_dict(),
        # did each label learn: its own accuracy at the last eval against step 0, paired by seed
        "learned": {lab: paired_difference(final[lab], start[lab]).to_dict() for lab in labels},
        "min_sign_flip_p": min_sign_flip_p(len(seeds)),
        "mcnemar": mc,
        "timing": timing(by, labels, seeds),
        "runs": {by[(lab, s)]["name"]: {k: by[(lab, s)]["run"].get(k) for k in
                                        ("label", "seed", "model", "max_steps", "settings", "mask", "heldout",
                                         "trainer", "processes", "command")} for lab in labels for s in seeds},
        "environment": ref["run"].get("environment"),
    }


# ------------------------------------------------------------------ the page and the figure
def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    steps = summary["eval_steps"]
    for lab, color in zip((summary["treatment"], summary["baseline"]), ("tab:blue", "tab:orange")):
        acc = summary["accuracy"][lab]
        for v in acc["per_seed"].values():
            ax.plot(steps, v, color=color, alpha=0.35, linewidth=1)
        ax.plot(steps, acc["mean"], color=color, linewidth=2.2, marker="o",
                label=f"{lab} (mean of {len(acc['per_seed'])} seeds; thin: each seed)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"held-out greedy accuracy ({summary['n_prompts']} prompts)")
    models = sorted({str(r.get("model")) for r in summary["runs"].values()})
    ax.set_title(f"TRL GRPO, {', '.join(models)}: held-out accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _p(p: float) -> str:
    from pdmask_lab.significance import format_p

    return format_p(p)


def _pd(d: dict) -> str:
    from pdmask_lab.significance import format_interval

    return (f"{format_interval(d['estimate'], d['lo'], d['hi'], sign=True)}, {d['wins']} up / {d['losses']} down "
            f"of {d['n']} seeds, sign-flip {_p(d['p'])}")


def _num(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def machine_line(env: dict | None) -> str:
    if not env:
        return "Machine: not recorded."
    pk = env.get("packages") or {}
    vers = ", ".join(f"{k} {pk[k]}" for k in ("torch", "trl", "transformers", "accelerate") if pk.get(k))
    return (f"Machine: {env.get('cpu_model')} ({env.get('cpu_count')} CPUs, {env.get('torch_threads')} torch "
            f"thread(s) per run); {vers}; python {env.get('python')}.")


def readme(summary: dict, command: str) -> str:
    t, b, n = summary["treatment"], summary["baseline"], len(summary["seeds"])
    acc, steps = summary["accuracy"], summary["eval_steps"]
    rows = [f"| {s} | " + " | ".join(f"{acc[lab]['mean'][i]:.3f}" for lab in (t, b)) + " |"
            for i, s in enumerate(steps)]
    mc = summary["mcnemar"]
    mc_line = ("McNemar: per-prompt scores are not 0/1, no test." if mc is None else
               f"McNemar's exact test on the final per-prompt correctness, pooled over {mc['n_seeds']} seeds x "
               f"{mc['n_prompts']} prompts = {mc['n_pairs']} pairs: only {t} right {mc['b']}, only {b} right "
               f"{mc['c']} ({mc['both']} both, {mc['neither']} neither), {_p(mc['p'])}.")
    tm = summary["timing"]
    time_rows = [f"| {name} | {v['steps']} | {_num(v['step_s_median'])} | {_num(v['eval_s_median'])} | "
                 f"{_num(v['wall_s'] and v['wall_s'] / 60)} |" for name, v in tm.items()]
    return "\n".join([
        "# TRL learning run: pdmask's mask against plain TRL GRPO",
        "",
        f"Written by `{command}` from the records in `records/` (one directory per run: `run.json`, "
        "`heldout.jsonl`, `steps.jsonl`, written by `examples/trl/train_grpo.py`); docs/trl.md explains the run.",
        "",
        "![held-out accuracy per step](heldout.png)",
        "",
        f"Held-out greedy accuracy, mean over seeds {', '.join(map(str, summary['seeds']))} "
        f"({summary['n_prompts']} prompts):",
        "",
        f"| step | {t} | {b} |",
        "|---|---|---|",
        *rows,
        "",
        f"- Final accuracy, {t} - {b}, paired by seed: {_pd(summary['paired_final'])}.",
        f"- Gain (final - step 0), {t} - {b}: {_pd(summary['paired_gain'])}. Both labels start from the same "
        "model, so their step-0 accuracies are equal and the two differences coincide unless a run's step 0 differs.",
        f"- {mc_line}",
        "- Learned (accuracy at the last eval - step 0, each label on its own, paired by seed): "
        + "; ".join(f"{lab} {_pd(d)}" for lab, d in summary["learned"].items()) + ".",
        "",
        "What this can show, and what it cannot:",
        "",
        f"- With {n} paired seeds the smallest two-sided sign-flip p is 2/2^{n} = {summary['min_sign_flip_p']:.3g}: "
        + (f"a difference reaches p < 0.05 only when all {n} seeds agree in sign, so only a difference large "
           "against the seed-to-seed spread can be detected. "
           if summary["min_sign_flip_p"] < 0.05 else
           "no difference can reach p < 0.05 whatever its size (that takes at least 6 seeds, all in one "
           "direction). ")
        + "The seed intervals describe these seeds, they are too narrow to generalise.",
        "- McNemar pools prompts x seeds as if every pair were independent. The prompts are the same in every "
        "seed and a seed's answers share one trained model, so its p-value says whether these trained models "
        "answer these prompts differently, not whether the loss makes a difference in expectation over training "
        "randomness; read it as descriptive.",
        "- What a few seeds do show: whether held-out accuracy moves at all under each loss over the run, and in "
        "which direction on each seed.",
        "",
        machine_line(summary["environment"]),
        "",
        "| run | steps | s/step (median) | s/eval (median) | wall (min) |",
        "|---|---|---|---|---|",
        *time_rows,
        "",
        "The seconds per step are those of the step (generation, scoring, update); the evaluations are timed apart.",
        "",
    ])


def report(a) -> int:
    runs, out = Path(a.runs), Path(a.out)
    try:
        import matplotlib  # noqa: F401
        import pdmask_lab.significance  # noqa: F401
    except ImportError as e:
        print(f"report: needs matplotlib and pdmask-lab ({e.name} is missing); run it in the main environment "
              "(pip install -e '.[train]' && pip install -e ./lab)", file=sys.stderr)
        return 2
    try:
        copy_records(load_runs(runs), out / "records")
        summary = summarize(load_runs(out / "records"), a.baseline)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    command = f"python examples/trl/learning_run.py report --runs {a.runs} --out {a.out}"
    if os.path.isabs(a.runs) or os.path.isabs(a.out):
        command = "python examples/trl/learning_run.py report --runs RUNS --out OUT"
    summary["written_by"] = command
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(summary, out / "heldout.png")
    (out / "README.md").write_text(readme(summary, command))
    print(f"wrote {out / 'README.md'}, {out / 'heldout.png'}, {out / 'summary.json'}")
    return 0


# ------------------------------------------------------------------ the command line
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the grid (TRL environment); finished runs are skipped")
    r.add_argument("--runs", default="runs/trl-learning", help="parent of the run directories")
    r.add_argument("--labels", nargs="+", default=list(LABELS), choices=list(LABELS))
    r.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    r.add_argument("--model", default="smollm2-135m")
    r.add_argument("--max-steps", type=int, default=24)
    r.add_argument("--eval-every", type=int, default=4)
    r.add_argument("--eval-prompts", type=int, default=None, help="default: the example's (all held-out problems)")
    r.add_argument("--jobs", type=int, default=1, help="runs at a time (each gets cpu_count / jobs torch threads "
                                                       "unless OMP_NUM_THREADS is set)")
    r.add_argument("--python", default=sys.executable, help="the interpreter of the TRL environment")
    r.add_argument("--example", default=str(EXAMPLE), help=argparse.SUPPRESS)
    r.add_argument("extra", nargs="*", help="after --: more arguments for train_grpo.py (the same for every run)")
    q = sub.add_parser("report", help="the report from the records (main environment)")
    q.add_argument("--runs", default="runs/trl-learning")
    q.add_argument("--out", default="docs/results/trl-learning")
    q.add_argument("--baseline", default=BASELINE)
    a = p.parse_args(argv)
    if a.cmd == "run":
        if a.jobs < 1:
            p.error(f"--jobs: must be >= 1, got {a.jobs}")
        return run_grid(a)
    return report(a)


if __name__ == "__main__":
    sys.exit(main())
