"""The RL loop, in one readable function (CleanRL style): :func:`train`.

Per step::

    sync      engine.load_weights(trainer, LoRA merged)  if step % sync_every == 0   (else the engine lags)
    rollout   prompts x group_size -> engine.generate -> tokens, log mu_k, top-K of mu
    reward    rule-based reward of each decoded response
    advantage GRPO: r - mean(group) [/ std(group)]          (the three: rollout.rollout_step)
    anchor    anchor: old only: one no-grad forward of the pre-update weights -> pi_old;
              with train_blocks, the frozen blocks' output is kept for the updates  (frozen_prefix.step_start)
    update    for each of `minibatches` slices (x epochs): one trainer forward ->
              cfg.loss (one pdmask.PolicyLoss) -> backward -> clip -> AdamW step
              (over the trainable parameters: all, top-N blocks or LoRA; trainable.py)
                                                            (update.select, update.update_step)
    log       JSONL + TensorBoard; held-out greedy accuracy every eval_every steps
    save      resumable checkpoint every checkpoint_every steps

How it departs from textbook GRPO (on purpose; this is what the masks are about):

- By default (``anchor: rollout``) the trust region is anchored to the **rollout engine's**
  policy mu (the log-probs the engine reported while sampling), not to a recomputed "old"
  trainer policy: there is no old-policy forward at all. The ratio ``r = pi_k / mu_k``
  therefore contains the training-inference mismatch (engine precision, policy lag) as
  well as the drift of the earlier mini-batch updates of the same step. With
  ``anchor: old`` one no-grad forward of the pre-update weights gives pi_old: the region
  measures pi against it, and ``min(pi_old / mu, C)`` corrects for the engine
  (:mod:`.anchoring`; docs/core.md, "Choosing the anchor").
- The loss is whatever ``cfg.loss`` (:class:`pdmask.PolicyLoss`) computes for its mode: for the
  divergence modes the DPPO-style ``-M sg(min(r, C)) A log pi_k``; for ``grpo`` the
  PPO clipped surrogate with clip-higher and dual clip. Masks are chosen by name.
- No KL-to-reference penalty, no entropy bonus; token-mean aggregation by default.
- ``minibatches > 1`` makes every update after the first off-policy, which is the
  setting where trust-region masks matter.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

import torch

from ..engine.registry import build_engine
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import TrainConfig
from .environment import environment, torch_threads
from .finite import first_nonfinite, stop, trained_parameters, watch
from .logging import RunLogger, read_jsonl, truncate_jsonl
from .portable import portable_path
from .loss_spec import mode_record, resolved_fields
from .model import encode_prompts, load_model_and_tokenizer, num_params
from .preflight import check_lengths, check_run
from .progress import make_progress
from .rollout import RolloutStep, greedy_eval, rollout_step, zero_advantage_warning
from .rundir import lock_run_dir, writing
from .sft import ensure_sft_checkpoint, sft_info
from .tasks import build_task, eval_rewards, get_reward
from .trainable import apply_variant, engine_state_dict, trainable_parameters, variant
from .anchoring import BindingLog, anchor_mismatch, region_warning
from .frozen_prefix import step_start
from .update import make_optimizer, select, update_step

__all__ = ["Setup", "TIME_KEYS", "open_run", "recorded_config", "rollout_seed", "setup", "step_metrics",
           "step_prompts", "summarize", "train"]

#: keys whose values depend on wall-clock time (excluded from resume comparisons)
TIME_KEYS = ("time_rollout_s", "time_update_s", "time_step_s", "time_eval_s", "tokens_per_s", "wall_s",
             "update_s_per_1k_tokens")


# ------------------------------------------------------------------ the data schedule
def step_prompts(step: int, cfg: TrainConfig, n_train: int) -> list[int]:
    """Training-problem indices of ``step``: consecutive slices of a seeded permutation per epoch.

    A pure function of (seed, step), so a resumed run draws exactly the same prompts."""
    out = []
    pos = step * cfg.prompts_per_step
    while len(out) < cfg.prompts_per_step:
        epoch, off = divmod(pos, n_train)
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
        perm = torch.randperm(n_train, generator=g)
        take = min(cfg.prompts_per_step - len(out), n_train - off)
        out += perm[off:off + take].tolist()
        pos += take
    return out


def rollout_seed(cfg: TrainConfig, step: int) -> int:
    """The engine's sampling seed of ``step`` (its mini-batch shuffle uses this + 1)."""
    return (cfg.seed * 7_919 + step * 104_729 + 17) % (2**62)


# ------------------------------------------------------------------ before the loop
@dataclass
class Setup:
    """Everything :func:`train` builds before the loop (also the direction audit's policy source)."""

    cfg: TrainConfig
    model: torch.nn.Module
    tokenizer: object
    engine: object
    optimizer: torch.optim.Optimizer
    task: object
    reward_fn: object
    train_ids: list
    eval_ids: list
    base_path: object


def setup(cfg: TrainConfig, console=None, *, keep_threads: bool = False) -> Setup:
    """SFT base (cached), model + tokenizer, task, encoded prompts, rollout engine, the
    trainable-parameter variant (frozen blocks, LoRA adapters), AdamW over what trains.

    Built at ``cfg.threads`` torch threads; the caller's thread count comes back when it
    returns (``keep_threads=True``: it stays ``cfg.threads``, for a command whose work follows)."""
    with torch_threads(cfg.threads, keep=keep_threads):
        return _setup(cfg, console)


def _setup(cfg: TrainConfig, console) -> Setup:
    base = ensure_sft_checkpoint(cfg, console=console)
    model, tok = load_model_and_tokenizer(base, cfg.device)
    model.train()
    task = build_task(cfg)
    tr = encode_prompts(tok, task.train, use_chat_template=cfg.use_chat_template)
    ev = encode_prompts(tok, task.eval, use_chat_template=cfg.use_chat_template)
    check_lengths(cfg, model, tr, ev)
    # the engine copies the plain base model (it never holds adapters: syncs send merged weights)
    engine = build_engine(cfg, model, tok)
    apply_variant(model, cfg)
    opt = make_optimizer(model, cfg)
    return Setup(cfg, model, tok, engine, opt, task, get_reward(cfg.reward), tr, ev, base)


def open_run(cfg: TrainConfig, *, resume: bool, console) -> tuple[Setup, int]:
    """:func:`setup`, then the run directory: a fresh one, or the latest checkpoint restored
    (metrics after it cut from ``metrics.jsonl``). Returns the setup and the first step."""
    run_dir = cfg.run_dir
    # a corrupt newest checkpoint falls back to the previous one, with a message
    ckpt = latest_checkpoint(run_dir, warn=lambda m: console.print(f"[yellow]warning:[/yellow] {m}")) if resume else None
    if not resume and (run_dir / "metrics.jsonl").exists():
        raise ValueError(f"name: run directory {str(run_dir)!r} already has metrics; pass --resume or a new name")
    S = setup(cfg, console)
    start = 0
    if ckpt is not None:
        # the checkpoint must be of this variant (its frozen set and adapters), checked before loading
        start = load_checkpoint(ckpt, model=S.model, optimizer=S.optimizer, engine=S.engine,
                                expect=variant(cfg))["step"]
        truncate_jsonl(run_dir / "metrics.jsonl", start)
        console.print(f"resuming {run_dir} from step {start}")
    elif resume:
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # killed before its first checkpoint
    run_dir.mkdir(parents=True, exist_ok=True)
    with writing(run_dir / "config.yaml"):
        (run_dir / "config.yaml").write_text(_yaml(recorded_config(cfg)))
    return S, start


#: the config keys config.yaml writes by :func:`pdmask.train.portable.portable_path`: where the run
#: and the cache were on the machine that ran it, which changes no result (config.NEUTRAL_KEYS)
PORTABLE_KEYS = ("out_dir", "cache_dir")


def recorded_config(cfg: TrainConfig) -> dict:
    """``cfg.to_dict()`` as ``config.yaml`` holds it: ``out_dir`` and ``cache_dir`` never absolute
    (relative to the working directory, ``~/...``, or their last two parts). ``model_path``,
    ``train_file`` and ``eval_file`` stay as given: a stored run is compared with a config by them
    (:func:`pdmask.train.config.config_diff`), and a named model (``smollm2-135m``) is no path."""
    d = cfg.to_dict()
    return {k: portable_path(v) if k in PORTABLE_KEYS and isinstance(v, str) and v else v for k, v in d.items()}


# ------------------------------------------------------------------ the loop
def train(cfg: TrainConfig, *, resume: bool = False, console=None) -> dict:
    """Run (or resume) RL training; returns the summary (also written to ``summary.json``).

    The configuration and the environment are checked first (:func:`preflight.check_run`),
    then the run directory is locked for this process (:func:`rundir.lock_run_dir`: a
    second process on it is refused) until the run ends."""
    from rich.console import Console

    console = console or Console()
    cfg.validate()
    check_run(cfg, resume=resume)
    # the run's thread count is its own; the caller's comes back
    with torch_threads(cfg.threads), lock_run_dir(cfg.run_dir):
        return _train(cfg, resume=resume, console=console)


def _train(cfg: TrainConfig, *, resume: bool, console) -> dict:
    S, start = open_run(cfg, resume=resume, console=console)
    model, tok, engine, opt = S.model, S.tokenizer, S.engine, S.optimizer
    run_dir = cfg.run_dir
    log = RunLogger(run_dir, tensorboard=cfg.tensorboard, purge_step=start + 1 if start else None)
    answers = [p.answer for p in S.task.train]
    ev_answers = [p.answer for p in S.task.eval]
    n = cfg.prompts_per_step * cfg.group_size  # rollouts per step
    mb = n // cfg.minibatches  # rollouts per mini-batch
    base = sft_info(S.base_path)
    scorers = eval_rewards(cfg)

    def evaluate(at: int) -> dict[str, float]:
        t, texts = time.time(), []
        ev = greedy_eval(model, tok, S.eval_ids, ev_answers, scorers, max_new_tokens=cfg.max_new_tokens, texts=texts)
        save_answers(run_dir, at, texts[:cfg.eval_answers])  # a few greedy answers, to read the format drift
        return {f"eval_{k}": v for k, v in ev.items()} | {"time_eval_s": time.time() - t}

    # a resumed run rewrites what followed its checkpoint (a fresh start: everything)
    truncate_jsonl(run_dir / "eval_answers.jsonl", start if start else -1)
    if start == 0:
        log.log({"step": 0, **evaluate(0), "num_params": num_params(model),
                 "num_trainable_params": sum(p.numel() for p in trainable_parameters(model)),
                 "sft_eval_accuracy": base.get("eval_greedy_accuracy")})
    t_run = time.time()
    warned = False  # the out-of-region-before-any-update warning, once per run
    with make_progress(cfg.progress, console) as prog:
        bar = prog.add_task(f"RL {cfg.run_name}", total=cfg.steps, completed=start)
        for step in range(start, cfg.steps):
            t0 = time.time()
            # --- sync: the engine gets the trainer's weights (LoRA merged, cast to its precision)
            if step % cfg.sync_every == 0 and step > 0:
                engine.load_weights(engine_state_dict(model))
            # --- rollout: group_size samples of each prompt (consecutive), rewards, GRPO advantages
            pidx = step_prompts(step, cfg, len(S.train_ids))
            ro = rollout_step(engine, tok, [S.train_ids[i] for i in pidx], [answers[i] for i in pidx], S.reward_fn,
                              group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
                              seed=rollout_seed(cfg, step), std_norm=cfg.adv_std_norm, return_logits=cfg.full_logits)
            batch, adv = ro.batch, ro.advantages  # sequences (n, P + T), advantages (n,)
            if (flat := zero_advantage_warning(ro)) is not None:
                console.print(f"[yellow]warning:[/yellow] step {step}: {flat}", soft_wrap=True)
            t1 = time.time()
            # --- updates: `minibatches` slices of a seeded shuffle, `epochs` passes
            g = torch.Generator().manual_seed(rollout_seed(cfg, step) + 1)
            plens = batch.attention_mask[:, :batch.prompt_len].sum(1).tolist()  # (n,) host ints, one sync
            rlens = batch.response_mask.sum(1).tolist()  # (n,)
            loss_metrics, grad_norms, first = [], [], None
            watched = []  # per mini-batch: loss, grad norm, weights finite? (finite.py: read with the step's sync)
            perms = [torch.randperm(n, generator=g).tolist() for _ in range(cfg.epochs)]
            # --- anchor old: pi_old, one no-grad forward for every mini-batch; the frozen blocks' output, once
            anchor, prefix = step_start(model, batch, adv, perms[0], mb, select, plens, rlens, cfg, check=step == start)
            binds = BindingLog(cfg.minibatches)  # where the region binds, by mini-batch index
            for perm in perms:
                for j in range(cfg.minibatches):
                    idx = perm[j * mb:(j + 1) * mb]
                    sub = select(batch, idx, plens, rlens)  # (mb, p + t), padding columns trimmed
                    # full input validation once per run (first update): the engine's outputs
                    # are then trusted and the hot path skips the host sync (loss.validate: always)
                    out, gn = update_step(model, opt, sub, adv[idx], cfg,
                                          validate=True if first is None and step == start else None,
                                          anchor=None if anchor is None else anchor.rows(idx, sub),
                                          prefix=None if prefix is None else prefix.rows(idx, sub, batch.prompt_len))
                    loss_metrics.append(out.metrics)
                    grad_norms.append(gn)
                    watched.append(watch(out.loss, gn, trained_parameters(opt)))
                    binds.update(j, out, sub, adv[idx], cfg, anchor, first=first is None)
                    if first is None:  # before any update of this step: pure engine-vs-trainer mismatch
                        first = _mismatch(out.stats, sub.response_mask) if anchor is None else \
                            anchor_mismatch(anchor.rows(idx, sub), sub.rollout, anchor.vocab_size)
            t2 = time.time()
            # --- log: one host sync for the step's metrics, then timings and (every eval_every) eval
            rec = step_metrics(ro, grad_norms, {**first, **binds.metrics()}, loss_metrics)
            if not warned and (warning := region_warning(rec, cfg)) is not None:
                warned = True
                console.print(f"[yellow]warning:[/yellow] step {step + 1}: {warning}", soft_wrap=True)
            if (bad := first_nonfinite(watched)) is not None:  # stop before eval, checkpoint, next sampling
                stop(step + 1, rec, bad, model=model, optimizer=opt, log=log, run_dir=run_dir, cfg=cfg,
                     summarize=lambda recs: {**summarize(recs, cfg, base), "environment": environment(cfg.threads)})
            ntok = sum(rlens)
            rec.update({"engine_lag": step % cfg.sync_every, "time_rollout_s": t1 - t0, "time_update_s": t2 - t1,
                        "update_s_per_1k_tokens": 1000 * (t2 - t1) / max(ntok, 1)})
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                rec.update(evaluate(step + 1))
            rec["time_step_s"] = time.time() - t0
            rec["tokens_per_s"] = ntok / max(t2 - t0, 1e-9)
            rec["wall_s"] = time.time() - t_run
            log.log({"step": step + 1, **rec})
            # --- save: resumable checkpoint
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                save_checkpoint(run_dir, step=step + 1, model=model, optimizer=opt, engine=engine,
                                extra={"data_pos": (step + 1) * cfg.prompts_per_step, **variant(cfg)},
                                keep=cfg.keep_checkpoints)
            prog.update(bar, advance=1, description=f"RL {cfg.run_name} reward {rec['reward']:.2f}"
                        + (f" eval {rec['eval_accuracy']:.2f}" if "eval_accuracy" in rec else ""))
    log.close()
    summary = summarize(read_jsonl(run_dir / "metrics.jsonl"), cfg, base)
    summary["environment"] = environment(cfg.threads)  # of this (the last) segment of the run
    with writing(run_dir / "summary.json"):
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def save_answers(run_dir, step: int, texts: list[str]) -> None:
    """Append the greedy answers of one eval to ``eval_answers.jsonl`` (nothing when none are kept)."""
    if texts:
        with writing(run_dir / "eval_answers.jsonl"), open(run_dir / "eval_answers.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "answers": texts}) + "\n")


# ------------------------------------------------------------------ metrics
def _mean(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([x.float() for x in xs]).mean()


def step_metrics(rollout: RolloutStep, grad_norms: list[torch.Tensor], mismatch: dict[str, torch.Tensor],
                 loss_metrics: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """The step's record, read back with one host sync: the rollout's metrics, the mean
    gradient norm, the first mini-batch's mismatch, and every loss metric over the
    mini-batches (``num_*`` counts summed, the rest averaged)."""
    vals = {**rollout.metrics, "grad_norm": _mean(grad_norms), **mismatch}
    per_key: dict[str, list[torch.Tensor]] = {}
    for m in loss_metrics:
        for k, v in m.items():
            per_key.setdefault(k, []).append(v)
    for k, v in per_key.items():
        vals[k] = torch.stack([x.float() for x in v]).sum() if k.startswith("num_") else _mean(v)
    dev = rollout.batch.sequences.device  # one device, one host sync for the whole record
    return dict(zip(vals, torch.stack([v.float().to(dev) for v in vals.values()]).tolist()))


def _mismatch(stats: dict, rmask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Engine-vs-trainer mismatch on the first mini-batch (before this step's updates)."""
    m = rmask.bool()
    den = m.sum().clamp(min=1)

    def mean(x):
        return torch.where(m, x.detach().float(), torch.zeros_like(x, dtype=torch.float32)).sum() / den

    out = {"mismatch_topk_kl": mean(stats["topk_kl"]), "mismatch_abs_log_ratio": mean(stats["log_ratio"].abs())}
    if "full_kl" in stats:
        out["mismatch_full_kl"] = mean(stats["full_kl"])
    return out


def summarize(records: list[dict], cfg: TrainConfig, base: dict | None = None) -> dict:
    """Headline numbers of a run from its metrics records."""
    steps = [r for r in records if r["step"] > 0]
    evals = [r for r in records if r.get("eval_accuracy") is not None]

    def med(k):
        xs = [r[k] for r in steps if r.get(k) is not None]
        return statistics.median(xs) if xs else None

    def mean_last(k, n=10):
        xs = [r[k] for r in steps[-n:] if r.get(k) is not None]
        return sum(xs) / len(xs) if xs else None

    def mean_all(k):
        xs = [r[k] for r in steps if r.get(k) is not None]
        return sum(xs) / len(xs) if xs else None

    return {
        "run": cfg.run_name, "mode": cfg.loss.mode, "seed": cfg.seed,
        # what the run used (issue 42): before, a delta left at the mode's default was written null
        **{k: v for k, v in resolved_fields(cfg.loss)["thresholds"].items() if k.startswith("delta")},
        "is_cap": cfg.loss.corrections.is_cap, **mode_record(cfg.loss),
        "engine_precision": cfg.engine_precision, "sync_every": cfg.sync_every,
        "steps": steps[-1]["step"] if steps else 0,
        "sft_eval_accuracy": (base or {}).get("eval_greedy_accuracy"),
        "eval_accuracy_start": evals[0]["eval_accuracy"] if evals else None,
        "eval_accuracy_final": evals[-1]["eval_accuracy"] if evals else None,
        "eval_accuracy_best": max(r["eval_accuracy"] for r in evals) if evals else None,
        "eval_last_number_accuracy_start": evals[0].get("eval_last_number_accuracy") if evals else None,
        "eval_last_number_accuracy_final": evals[-1].get("eval_last_number_accuracy") if evals else None,
        "reward_last10": mean_last("reward"),
        "mismatch_topk_kl_mean": mean_all("mismatch_topk_kl"),
        "masked_frac_mean": mean_all("masked_frac"),
        "out_of_region_frac_mean": mean_all("out_of_region_frac"),
        "disagreement_frac_mean": mean_all("disagreement_frac"),
        "entropy_last10": mean_last("entropy_mean"),
        "finish_rate_last10": mean_last("finish_rate"),
        "eval_finished_final": evals[-1].get("eval_finished") if evals else None,
        "time_step_s_median": med("time_step_s"),
        "time_update_s_median": med("time_update_s"),
        "update_s_per_1k_tokens_median": med("update_s_per_1k_tokens"),
        "wall_s": steps[-1].get("wall_s") if steps else None,
    }


def _yaml(d: dict) -> str:
    import yaml

    return yaml.safe_dump(d, sort_keys=False)
