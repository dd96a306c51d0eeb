"""``pdmask compare``: several mask modes (x seeds x thresholds) on identical data.

All runs share the SFT base (trained once, cached), the task, the prompt order and the
rollout seeds of each RL seed, so they differ only by the mode (and delta). Outputs in
``out/``: one run directory per run, ``report/*.png``, ``summary.json`` (per-run
summaries, the step-time ratios, wall time, machine load, and under ``across_seeds`` the
per-mode summary over seeds with paired differences against ``reference``: see
:mod:`pdmask_lab.seed_summary`) and ``summary.md``. ``pdmask report OUT`` rebuilds
the across-seed part of both files from the run directories without rerunning anything.

Step-time ratio of two modes, measured two ways:

- ``runs``: the ratio of the median per-step update time per 1000 response tokens of the
  two runs (same machine, but different trajectories; with ``--jobs 2`` the pair is
  scheduled side by side so both see the same load, otherwise they run one after the
  other and a shared machine's load changes in between);
- ``interleaved``: one fixed rollout batch from the SFT base, the loss forward+backward
  of each mode timed alternately ``reps`` times in one process (the cleaner figure on a
  shared machine).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from pdmask.train.checkpoint import drop_checkpoints
from pdmask.train.config import TrainConfig, replace
from pdmask.train.environment import environment
from pdmask.train.grpo import rollout_seed, setup, step_prompts, train
from pdmask.train.portable import portable_path
from pdmask.train.update import compute_loss, select
from .report import find_runs, load_summaries, plot_runs, summary_table, write_summary
from pdmask.train.rollout import decode_responses, group_advantages, rewards_for
from .seed_summary import DEFAULT_REFERENCE, labelled_delta, seed_summary, seed_tables
from pdmask.train.sft import ensure_sft_checkpoint, sft_info


#: (baseline, predictive) modes whose step-time ratio is reported
PAIRS = [("dppo-topk-kl", "pdm-topk-kl"), ("dppo-topk-tv", "pdm-topk-tv")]


def plan_runs(cfg: TrainConfig, modes: list[str], seeds: int, deltas: list[float] | None,
              out_dir: str) -> list[TrainConfig]:
    """One config per (delta, mode, seed); ``grpo`` (a ratio clip) ignores deltas. At most
    :data:`pdmask.train.config.MAX_SEEDS` seeds per mode, the last one a 32-bit seed: a huge
    count is refused at once instead of validating one config per seed for ever."""
    from pdmask.train.config import MAX_SEEDS, SEED_MAX

    if seeds < 1:
        raise ValueError(f"seeds: must be >= 1, got {seeds}")
    if seeds > MAX_SEEDS:
        raise ValueError(f"seeds: must be at most {MAX_SEEDS} per mode (each is a training run), got {seeds}")
    if cfg.seed + seeds - 1 > SEED_MAX:
        raise ValueError(f"seeds: the last seed (seed {cfg.seed} + seeds - 1 = {cfg.seed + seeds - 1}) must be at "
                         f"most {SEED_MAX}")
    if not modes:
        raise ValueError("modes: give at least one mode")
    runs = []
    for d in (deltas or [None]):
        for mode in modes:
            if d is not None and mode == "grpo" and any(r.loss.mode == "grpo" for r in runs):
                continue
            for s in range(cfg.seed, cfg.seed + seeds):
                name = f"{mode}-s{s}" + (f"-d{d:g}" if d is not None and mode != "grpo" else "")
                ch = {"loss.mode": mode, "seed": s, "name": name, "out_dir": out_dir}
                if d is not None and mode != "grpo":
                    ch.update({"loss.thresholds.delta_low": d, "loss.thresholds.delta_high": d})
                runs.append(replace(cfg, ch))
    return runs


def _yaml(d: dict) -> str:
    import yaml

    return yaml.safe_dump(d, sort_keys=False)


def _run_subprocesses(cfgs: list[TrainConfig], jobs: int, resume: bool, out: Path, console,
                      drop: bool = False) -> None:
    """Run ``cfgs`` as ``pdmask train`` subprocesses, ``jobs`` at a time, each writing its
    console output to ``OUT/<run>.log``; one live display shows each running run's step,
    last reward and ETA (:mod:`pdmask_lab.live`); ``drop``: each run's checkpoints are
    deleted once it has finished."""
    from .live import RunsProgress

    cdir = out / ".configs"
    cdir.mkdir(parents=True, exist_ok=True)
    pending = list(cfgs)
    live: list[tuple[subprocess.Popen, TrainConfig, object]] = []
    with RunsProgress(console, len(cfgs)) as prog:
        try:
            while pending or live:
                while pending and len(live) < jobs:
                    c = replace(pending.pop(0), progress=False)
                    p = cdir / f"{c.run_name}.yaml"
                    p.write_text(_yaml(c.to_dict()))
                    cmd = [sys.executable, "-m", "pdmask.cli", "train", "--config", str(p)] + (["--resume"] if resume else [])
                    log = open(out / f"{c.run_name}.log", "w")
                    live.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), c, log))
                    prog.started(c.run_name, c.run_dir, c.steps, out / f"{c.run_name}.log")
                time.sleep(0.5)
                prog.refresh()
                for item in list(live):
                    pr, c, log = item
                    if pr.poll() is None:
                        continue
                    live.remove(item)
                    log.close()
                    if pr.returncode != 0:
                        raise RuntimeError(f"run {c.run_name} failed (exit {pr.returncode}); see {out / (c.run_name + '.log')}")
                    if drop:
                        drop_checkpoints(c.run_dir)
                    prog.finished(c.run_name)
        finally:
            for pr, *_ in live:  # an error: stop the other runs (--resume continues them)
                pr.kill()
                pr.wait()


def _finished(c: TrainConfig, console) -> bool:
    if (c.run_dir / "summary.json").exists():
        console.print(f"done {c.run_name} (its summary.json exists; delete {c.run_dir} to run it again)",
                      markup=False, soft_wrap=True)
        return True
    return False


def _checkpoint_policy(cfgs: list[TrainConfig], keep: int | None, out: Path, console) -> tuple[list[TrainConfig], bool]:
    """The runs' configs with ``keep_checkpoints`` applied, and whether each run's checkpoints
    are dropped once it has finished (``keep == 0``); says where each run's files go."""
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 0):
        raise ValueError(f"keep_checkpoints: must be an int >= 0 (0: none once a run has finished), got {keep!r}")
    if keep is not None:
        cfgs = [replace(c, keep_checkpoints=max(keep, 1)) for c in cfgs]
    n = cfgs[0].keep_checkpoints if cfgs else 0
    what = "none once it has finished" if keep == 0 else "the last" if n == 1 else f"the last {n}"
    console.print(f"{len(cfgs)} runs; each run's records in {out}/<run>/, its checkpoints in {out}/<run>/checkpoints/ "
                  f"({what}; --keep-checkpoints N), its console log in {out}/<run>.log with --jobs > 1",
                  markup=False, soft_wrap=True)
    return cfgs, keep == 0


def loss_time_ratio(cfg: TrainConfig, mode_a: str, mode_b: str, *, reps: int = 15) -> dict:
    """Interleaved timing of ``compute_loss`` + backward for two modes on one fixed batch.

    Returns medians (seconds) and ``ratio = median_b / median_a``."""
    S = setup(replace(cfg, {"loss.mode": mode_a}, progress=False), keep_threads=True)  # timed at cfg.threads
    pidx = step_prompts(0, cfg, len(S.train_ids))
    prompts = [S.train_ids[i] for i in pidx for _ in range(cfg.group_size)]
    batch = S.engine.generate(prompts, max_new_tokens=cfg.max_new_tokens, seed=rollout_seed(cfg, 0),
                              return_logits=cfg.full_logits)
    answers = [S.task.train[i].answer for i in pidx for _ in range(cfg.group_size)]
    rewards = rewards_for(decode_responses(S.tokenizer, batch), answers, S.reward_fn)
    adv = group_advantages(rewards, cfg.group_size, std_norm=cfg.adv_std_norm)
    if bool((adv == 0).all()):  # all groups uniform: time with nonzero advantages anyway
        adv = torch.linspace(-1, 1, adv.numel())
    mb = (cfg.prompts_per_step * cfg.group_size) // cfg.minibatches
    idx = list(range(mb))
    sub = select(batch, idx, batch.attention_mask[:, :batch.prompt_len].sum(1).tolist(),
                 batch.response_mask.sum(1).tolist())
    cfgs = {m: replace(cfg, {"loss.mode": m}) for m in (mode_a, mode_b)}
    times = {mode_a: [], mode_b: []}
    for r in range(reps + 2):
        order = (mode_a, mode_b) if r % 2 == 0 else (mode_b, mode_a)
        for m in order:
            _sync(cfg.device)
            t = time.perf_counter()
            out = compute_loss(S.model, sub, adv[idx], cfgs[m])
            out.loss.backward()
            S.model.zero_grad(set_to_none=True)
            _sync(cfg.device)
            if r >= 2:  # two warm-up rounds
                times[m].append(time.perf_counter() - t)
    a, b = statistics.median(times[mode_a]), statistics.median(times[mode_b])
    return {"mode_a": mode_a, "mode_b": mode_b, "median_a_s": a, "median_b_s": b, "ratio": b / a,
            "reps": reps, "tokens": int(sub.response_mask.sum())}


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def run_compare(cfg: TrainConfig, *, modes: list[str], seeds: int = 1, deltas: list[float] | None = None,
                out: str | Path | None = None, jobs: int = 1, resume: bool = False, timing: bool = True,
                reference: str = DEFAULT_REFERENCE, keep_checkpoints: int | None = None, console=None) -> dict:
    """Run every (delta, mode, seed), then write ``summary.json`` / ``summary.md`` and plots.

    ``reference``: the mode every other mode is compared with, seed by seed (must be one
    of ``modes``; checked before anything runs). ``keep_checkpoints``: the checkpoints each
    run keeps (None: the config's ``keep_checkpoints``, 2 by default; 1: the last; 0: none
    once the run has finished, so it can no longer be resumed, extended or audited). A run
    that has finished (its ``summary.json`` exists) is not run again."""
    from rich.console import Console

    if reference not in modes:
        raise ValueError(f"reference: mode {reference!r} is not among the compared modes ({', '.join(modes)}); "
                         f"pass --reference with one of them")
    console = console or Console()
    out = Path(out or Path(cfg.out_dir) / f"compare-{cfg.name or 'default'}")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    load0 = os.getloadavg()
    cfgs = plan_runs(cfg, modes, seeds, deltas, str(out))
    console.print(f"plan: {len(cfgs)} runs ({len(modes)} modes x {seeds} seeds"
                  + (f" x {len(deltas)} deltas" if deltas else "") + ")")
    cfgs, drop = _checkpoint_policy(cfgs, keep_checkpoints, out, console)
    sft_t = time.time()
    base = ensure_sft_checkpoint(cfg, console=console)  # once, before any run (runs then hit the cache)
    sft_s = time.time() - sft_t
    console.print(f"SFT base: {base} (greedy held-out accuracy {sft_info(base).get('eval_greedy_accuracy')})")
    if jobs > 1:
        # Paired modes (dppo-*/pdm-*) first, in plan order: with --jobs 2 each pair then runs
        # side by side under the same machine load, which keeps their run-median ratio fair.
        paired = {m for pair in PAIRS for m in pair}
        cfgs = sorted(cfgs, key=lambda c: (c.loss.mode not in paired, c.loss_fields["thresholds"]["delta_high"] or 0.0,
                                           c.seed))
        _run_subprocesses([c for c in cfgs if not _finished(c, console)], jobs, resume, out, console, drop)
    else:
        for c in cfgs:
            if not _finished(c, console):
                train(c, resume=resume, console=console)
                if drop:
                    drop_checkpoints(c.run_dir)
    runs_s = time.time() - t0 - sft_s
    summaries = load_summaries(find_runs([out]))
    res: dict = {"runs": summaries, "sft": sft_info(base), "sft_wall_s_this_call": sft_s, "rl_wall_s": runs_s,
                 "environment": environment(cfg.threads),
                 "load_avg_start": load0, "threads": cfg.threads, "jobs": jobs, "cpu_count": os.cpu_count()}
    by_mode = {}
    for s in summaries:
        # a delta at the mode's default is no delta in a label (a run since issue 42 records it as a number)
        d = labelled_delta({"mode": s["mode"], "thresholds": {"delta_high": s.get("delta_high")}})
        by_mode.setdefault((s["mode"], d), []).append(s)
    pairs = PAIRS
    res["step_time_ratio_runs"] = {}
    for a, b in pairs:
        for d in sorted({k[1] for k in by_mode}, key=lambda x: (x is None, x)):
            if (a, d) in by_mode and (b, d) in by_mode:
                def med(k, m):
                    return statistics.median(s[k] for s in by_mode[(m, d)] if s.get(k) is not None)
                res["step_time_ratio_runs"][f"{b}/{a}" + (f" d={d}" if d is not None else "")] = {
                    "update_s_per_1k_tokens": med("update_s_per_1k_tokens_median", b) / med("update_s_per_1k_tokens_median", a),
                    "time_step_s": med("time_step_s_median", b) / med("time_step_s_median", a)}
    if timing:
        for a, b in pairs:
            if a in modes and b in modes:
                res.setdefault("step_time_ratio_interleaved", {})[f"{b}/{a}"] = loss_time_ratio(cfg, a, b)
    res["total_wall_s"] = time.time() - t0
    res["load_avg_end"] = os.getloadavg()
    runs = find_runs([out])
    res["across_seeds"] = seed_summary(runs, reference=reference, require_reference=True)
    pngs = plot_runs(runs, out / "report")
    res["plots"] = [portable_path(p, base=out) for p in pngs]  # relative to the compare directory
    (out / "summary.json").unlink(missing_ok=True)  # this call's results replace an earlier summary
    write_summary(out, res)
    console.print(summary_table(summaries, title=f"pdmask compare ({out})"))
    for t in seed_tables(res["across_seeds"]):
        console.print(t)
    for line in res["across_seeds"]["resolution"] + res["across_seeds"]["notes"]:
        console.print(line)
    for k, v in res.get("step_time_ratio_interleaved", {}).items():
        console.print(f"step-time ratio {k} (interleaved loss fwd+bwd): {v['ratio']:.3f}")
    for k, v in res["step_time_ratio_runs"].items():
        console.print(f"step-time ratio {k} (run medians, per 1k tokens): {v['update_s_per_1k_tokens']:.3f}")
    console.print(f"total wall time {res['total_wall_s']:.0f} s (SFT {sft_s:.0f} s), plots in {out / 'report'}")
    return res

