"""``pdmask audit`` and ``pdmask audit-grid``: the typer commands (options only).

Registered on the main CLI (:mod:`pdmask.cli`) with :func:`register`; the work is in
:mod:`.command` (the audit) and :mod:`.grid` (the grid over model shapes). The model,
task, engine and loss settings are the trainer's (``--config`` preset and ``--set
key=value`` overrides, the same keys as ``pdmask train``); the options are the audit's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..significance import DEFAULT_N_BOOT
from .config import FIDELITY_KS_ARG

HELP = ("Direction audit: does a direction criterion (ratio vs predictive Ddot) predict the "
        "divergence change of an update? Writes audit.json, audit.md, audit_tokens.npz and PNG plots.")


def audit_command(
    out: Path = typer.Option(Path("audit"), "--out", "-o", help="output directory"),
    model: str = typer.Option("", "--model", help="local HF model directory, a named source (smollm2-135m) or a "
                                                  "`pdmask train` run directory (default: the trainer config's "
                                                  "model_path, else its built-in SFT model)"),
    config: Optional[Path] = typer.Option(None, "--config", help="trainer YAML preset (model, task, engine, loss)"),
    set_: List[str] = typer.Option([], "--set", help="trainer config override key=value (repeatable)"),
    seeds: int = typer.Option(20, "--seeds", help="number of rollout batches (seeds) to audit"),
    seed_offset: int = typer.Option(0, "--seed-offset", help="first seed"),
    precision: Optional[str] = typer.Option(None, "--precision", help="engine precision: fp32, bf16, fp16, fp8, "
                                                                        "fp8-bf16 (default: the trainer config's)"),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="sampling temperature"),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="K of the engine's reported top-K"),
    lag: int = typer.Option(0, "--lag", help="policy steps ahead of the engine (the engine keeps the checkpoint); "
                                             "their AdamW state is the optimizer state of the batch steps"),
    divergence: str = typer.Option("topk_kl", "--divergence", help="topk_kl, topk_tv, full_kl, full_tv"),
    delta: Optional[float] = typer.Option(None, "--delta", help="delta_low = delta_high (default 0.05 KL, 0.15 TV)"),
    delta_low: Optional[float] = typer.Option(None, "--delta-low", help="threshold for A < 0 (overrides --delta)"),
    delta_high: Optional[float] = typer.Option(None, "--delta-high", help="threshold for A > 0 (overrides --delta)"),
    estimator: str = typer.Option("exact", "--estimator", help="headline predictive criterion's top-K estimator"),
    step_mode: str = typer.Option("none", "--step-mode", help="mask mode of the batch step itself"),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw, adam, sgd"),
    lr: Optional[float] = typer.Option(None, "--lr", help="batch-step learning rate (default: the trainer's lr)"),
    sample_tokens: int = typer.Option(32, "--sample-tokens", help="uniform sample of O per seed for the per-token "
                                                                  "instruments"),
    disagreement_tokens: int = typer.Option(-1, "--disagreement-tokens",
                                            help="headline disagreement tokens per seed the instruments measure "
                                                 "too (-1: all)"),
    instruments: str = typer.Option("param,precond,own,isolated", "--instruments",
                                    help="per-token instruments: param, precond, own, isolated, isolated-head "
                                         "(comma-separated; '' for none)"),
    isolated_step: float = typer.Option(1e-5, "--isolated-step", help="parameter-space step length"),
    logit_step: float = typer.Option(1e-7, "--logit-step", help="logit-space step length"),
    tie_tol: float = typer.Option(0.0, "--tie-tol", help="|dD| <= tie_tol counts as no change"),
    delta_sweep: str = typer.Option("", "--delta-sweep", help="larger deltas whose headline tables are recomputed "
                                                              "from the records (comma-separated)"),
    fidelity_ks: str = typer.Option(FIDELITY_KS_ARG, "--fidelity-ks", help="K values of the fidelity sweep"),
    bootstrap: int = typer.Option(DEFAULT_N_BOOT, "--bootstrap", help="seed-cluster bootstrap resamples"),
    jobs: int = typer.Option(1, "--jobs", help="worker processes (each uses `threads` torch threads)"),
    fresh: bool = typer.Option(False, "--fresh", help="discard seeds already in OUT/seeds and start over"),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="write the PNG plots"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="progress bars"),
) -> None:
    """Direction audit: does a direction criterion predict the divergence change?"""
    args = dict(locals())
    from .command import run_cli

    run_cli(**args)  # a ValueError / OSError becomes one line: pdmask.cli.user_errors wraps every command


def register(app: typer.Typer) -> None:
    """Add the ``audit`` and ``audit-grid`` commands to a typer app (the main ``pdmask`` CLI)."""
    from .grid import GRID_HELP, grid_command

    app.command("audit", help=HELP)(audit_command)
    app.command("audit-grid", help=GRID_HELP)(grid_command)
