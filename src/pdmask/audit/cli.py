"""``pdmask audit``: the direction audit on a checkpoint (METHOD.md section 5).

Registered on the main CLI (:mod:`pdmask.cli`) with :func:`register`. The model, task,
engine and loss settings are the trainer's (``--config`` preset and ``--set key=value`` overrides, the same keys as
``pdmask train``); the options below are the audit's own.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

HELP = ("Direction audit: does a direction criterion (ratio vs predictive Ddot) predict the realized "
        "divergence change of an update? Writes audit.json, audit.md, audit_tokens.npz and PNG plots.")


def audit_command(
    out: Path = typer.Option(Path("audit"), "--out", "-o", help="output directory"),
    model: str = typer.Option("", "--model", help="local HF model directory or a `pdmask train` run directory "
                                                  "(default: the built-in SFT model of the trainer config)"),
    config: Optional[Path] = typer.Option(None, "--config", help="trainer YAML preset (model, task, engine, loss)"),
    set_: List[str] = typer.Option([], "--set", help="trainer config override key=value (repeatable)"),
    seeds: int = typer.Option(20, "--seeds", help="number of rollout batches (seeds) to audit"),
    seed_offset: int = typer.Option(0, "--seed-offset", help="first seed"),
    precision: Optional[str] = typer.Option(None, "--precision", help="engine precision: fp32, bf16, fp16, fp8, "
                                                                        "fp8-bf16 (default: the trainer config's)"),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="sampling temperature"),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="K of the engine's reported top-K"),
    lag: int = typer.Option(0, "--lag", help="policy steps ahead of the engine (the engine keeps the checkpoint)"),
    divergence: str = typer.Option("topk_kl", "--divergence", help="topk_kl, topk_tv, full_kl, full_tv"),
    delta: Optional[float] = typer.Option(None, "--delta", help="delta_low = delta_high (default 0.05 KL, 0.15 TV)"),
    delta_low: Optional[float] = typer.Option(None, "--delta-low", help="threshold for A < 0 (overrides --delta)"),
    delta_high: Optional[float] = typer.Option(None, "--delta-high", help="threshold for A > 0 (overrides --delta)"),
    estimator: str = typer.Option("exact", "--estimator", help="headline predictive criterion's top-K estimator"),
    step_mode: str = typer.Option("none", "--step-mode", help="mask mode of the batch step itself"),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw, adam, sgd"),
    lr: Optional[float] = typer.Option(None, "--lr", help="batch-step learning rate (default: the trainer's lr)"),
    isolated_tokens: int = typer.Option(32, "--isolated-tokens", help="uniform sample of O per seed"),
    isolated_disagreement: int = typer.Option(32, "--isolated-disagreement", help="disagreement tokens per seed"),
    isolated_step: float = typer.Option(1e-5, "--isolated-step", help="parameter-space step length"),
    isolated_params: str = typer.Option("all", "--isolated-params", help="parameters the isolated step moves: "
                                        "all, head (output embedding), or all,head (both, one table each)"),
    logit_step: float = typer.Option(1e-7, "--logit-step", help="logit-space step length"),
    tie_tol: float = typer.Option(0.0, "--tie-tol", help="|dD| <= tie_tol counts as no change"),
    bootstrap: int = typer.Option(10000, "--bootstrap", help="bootstrap resamples over seeds"),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="write the PNG plots"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="progress bars"),
) -> None:
    """Direction audit: does a direction criterion predict the realized divergence change?"""
    try:
        run_cli(**locals())
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)


def run_cli(*, out, model, config, set_, seeds, seed_offset, precision, temperature, top_k, lag, divergence,
            delta, delta_low, delta_high, estimator, step_mode, optimizer, lr, isolated_tokens,
            isolated_disagreement, isolated_step, isolated_params, logit_step, tie_tol, bootstrap, plots,
            progress) -> dict:
    from rich.console import Console

    from ..train.checkpoint import is_run_dir
    from ..train.config import load_config
    from ..train.update import ADAMW_BETAS
    from .config import AuditConfig
    from .report import write_report
    from .runner import run_audit, summarize_all
    from .source import build_source

    if seeds < 1:
        raise ValueError(f"seeds: must be >= 1, got {seeds}")
    over = list(set_)
    for key, val in (("engine_precision", precision), ("temperature", temperature), ("top_k", top_k)):
        if val is not None:
            over.append(f"{key}={val}")
    over.append(f"progress={'true' if progress else 'false'}")
    if config is None and model and is_run_dir(model):
        config = Path(model) / "config.yaml"  # the run's own model/task/engine/loss settings
    tcfg = load_config(config, over)
    fam_default = 0.05 if divergence.endswith("kl") else 0.15
    base = fam_default if delta is None else delta
    cfg = AuditConfig(
        divergence=divergence, delta_low=base if delta_low is None else delta_low,
        delta_high=base if delta_high is None else delta_high, estimator=estimator, step_mode=step_mode,
        optimizer=optimizer, lr=tcfg.lr if lr is None else lr, weight_decay=tcfg.weight_decay, betas=ADAMW_BETAS,
        grad_clip=tcfg.grad_clip, is_cap=tcfg.is_cap, loss_agg=tcfg.loss_agg, eps_low=tcfg.eps_low,
        eps_high=tcfg.eps_high, temperature=tcfg.temperature, isolated_tokens=isolated_tokens,
        isolated_disagreement=isolated_disagreement, isolated_step=isolated_step,
        isolated_params=tuple(x.strip() for x in isolated_params.split(",") if x.strip()), logit_step=logit_step,
        tie_tol=tie_tol, bootstrap=bootstrap,
    )
    console = Console(stderr=True)
    t0 = time.time()
    src = build_source(tcfg, model=model, lag=lag, console=console)
    state = src.optimizer_state if optimizer != "sgd" else None
    t1 = time.time()
    results = run_audit(src.model, src.forward, src.sample, range(seed_offset, seed_offset + seeds), cfg,
                        progress=progress, optimizer_state=state, console=console)
    summary = summarize_all(results, cfg)
    run = {"command": "pdmask " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
           "seeds": f"{seed_offset}..{seed_offset + seeds - 1}", **src.info,
           "optimizer_state": src.info.get("optimizer_state", "from the lag steps" if lag else "fresh")
           if state is not None else "fresh",
           "trainer_config": tcfg.to_dict(), "setup_s": round(t1 - t0, 1)}
    doc = write_report(out, results, summary, cfg, run_settings=run, plots=plots, runtime_s=round(time.time() - t0, 1))
    console.print(f"audit: wrote {Path(out) / 'audit.md'} ({seeds} seeds, {time.time() - t0:.0f} s)")
    return doc


def register(app: typer.Typer) -> None:
    """Add the ``audit`` command to a typer app (the main ``pdmask`` CLI)."""
    app.command("audit", help=HELP)(audit_command)

