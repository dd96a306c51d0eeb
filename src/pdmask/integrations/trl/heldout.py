"""Held-out evaluation during a TRL run, and one readable line per step: two ``TrainerCallback``s.

- :class:`HeldoutCallback` runs ``evaluate(model)`` at the start of training (step 0), every
  ``every`` optimizer steps and at the last step, and appends one JSON line per evaluation to
  ``<output_dir>/heldout.jsonl``: ``step``, ``accuracy``, ``finished`` (the share of answers
  that end), ``n_prompts``, the per-prompt ``scores`` (the input of a McNemar test between
  two runs on the same prompts), ``eval_s`` and ``wall_s`` (seconds since training began),
  plus any other number ``evaluate`` returns (``length``).
- :class:`StepLineCallback` prints, from the values TRL logs (no extra host sync in the loss),
  ``step 3/24  reward 0.38  kept 0.91  heldout 0.42 @2 (step 0: 0.31)  12.3 s/step`` per step
  and appends the same values to ``<output_dir>/steps.jsonl``. ``kept`` is pdmask's
  ``pdmask/kept_frac``; under TRL's own loss it is ``clipped`` (``clip_ratio/region_mean``).
  ``reward`` is that of the generation batch the step trained on (logged on the steps that
  generate, carried over the steps that reuse the batch). The seconds are those of the step
  (generation, scoring, update), not of the evaluation that follows it.

:func:`heldout_callbacks` returns both in the order that keeps the evaluation out of the
step's time. The evaluation itself is the caller's (``evaluate(model) -> {"accuracy",
"finished", "scores", ...}``): this package's layer imports nothing of ``pdmask.train``
(docs/ARCHITECTURE.md), so ``examples/trl/train_grpo.py`` composes it from the built-in
trainer's task and its greedy evaluation (``pdmask.train.rollout.greedy_eval``).

Several processes (torchrun / accelerate, DDP): only the main process evaluates, prints and
writes, on the unwrapped model the callbacks receive (its weights are every rank's after the
step); the other ranks go on and wait for it at the next collective. That needs the whole
model on the main process: under FSDP or DeepSpeed ZeRO-3 the weights are sharded and this
evaluation does not apply. Naive equivalent: ``if step % every == 0: json.dump(evaluate(model))``.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Callable, Mapping

from transformers import TrainerCallback

HELDOUT_FILE = "heldout.jsonl"
STEPS_FILE = "steps.jsonl"


def _print(line: str) -> None:
    print(line, flush=True)  # a line per step is read as it comes, also through a pipe


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # a line cut by a killed run


def _reset(path: Path, before_step: int) -> None:
    """Keep the records of ``path`` for steps below ``before_step`` (a fresh run: none)."""
    if not path.exists():
        return
    kept = [ln for ln in path.read_text().splitlines() if (s := _step_of(ln)) is not None and s < before_step]
    path.write_text("".join(ln + "\n" for ln in kept))


def _append(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def check_result(res) -> dict:
    """``evaluate``'s result as a record: ``accuracy`` and ``finished`` finite numbers,
    ``scores`` a non-empty list of finite numbers; one ``ValueError`` line naming what is wrong."""
    if not isinstance(res, Mapping):
        raise ValueError("evaluate: must return a mapping with accuracy, finished and scores, got "
                         f"{type(res).__name__}")
    missing = [k for k in ("accuracy", "finished", "scores") if k not in res]
    if missing:
        raise ValueError(f"evaluate: the result lacks {', '.join(missing)}")
    scores = list(res["scores"])
    if not scores or not all(isinstance(s, (int, float)) and math.isfinite(s) for s in scores):
        raise ValueError("evaluate: scores must be a non-empty list of finite numbers (one per held-out prompt)")
    out = {}
    for k, v in res.items():
        if k == "scores":
            continue
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"evaluate: {k} must be a finite number, got {v!r}")
        out[k] = float(v)
    return {**out, "n_prompts": len(scores), "scores": [float(s) for s in scores]}


class HeldoutCallback(TrainerCallback):
    """``evaluate(model)`` at step 0, every ``every`` steps and at the last; records in
    ``<output_dir>/heldout.jsonl`` (module docstring). ``latest`` and ``first`` hold the last
    and the first record of this process (None on the other ranks)."""

    def __init__(self, evaluate: Callable[[object], Mapping], *, every: int):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every: must be a positive integer (optimizer steps between evaluations), got {every!r}")
        self.evaluate, self.every = evaluate, every
        self.latest: dict | None = None
        self.first: dict | None = None
        self._t0 = time.time()
        self._path: Path | None = None

    def _run(self, state, model) -> None:
        if not state.is_world_process_zero:
            return
        t = time.time()
        rec = {"step": state.global_step, **check_result(self.evaluate(model))}
        rec.update(eval_s=time.time() - t, wall_s=time.time() - self._t0)
        _append(self._path, rec)
        self.latest = rec
        if self.first is None:
            self.first = rec

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._t0 = time.time()
        self._path = Path(args.output_dir) / HELDOUT_FILE
        if state.is_world_process_zero:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            _reset(self._path, state.global_step)  # a resumed run rewrites what followed its checkpoint
        self._run(state, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self._run(state, model)


def _fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


class StepLineCallback(TrainerCallback):
    """One line per step on the main process, and ``<output_dir>/steps.jsonl`` (module docstring).
    ``heldout``: the :class:`HeldoutCallback` whose latest accuracy the line shows."""

    def __init__(self, heldout: HeldoutCallback | None = None, *, print_fn: Callable[[str], None] = _print):
        self.heldout, self.print = heldout, print_fn
        self.records: list[dict] = []
        self._t_step = self._dt = None
        self._reward = None
        self._path: Path | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._path = Path(args.output_dir) / STEPS_FILE
        if state.is_world_process_zero:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            _reset(self._path, state.global_step + 1)

    def on_step_begin(self, args, state, control, **kwargs):
        self._t_step = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        self._dt = None if self._t_step is None else time.time() - self._t_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "loss" not in logs:
            return  # the end-of-training summary (train_runtime, ...) has no "loss"
        if "reward" in logs:
            self._reward = logs["reward"]
        rec = {"step": state.global_step, "reward": self._reward, "loss": logs.get("loss"),
               "grad_norm": logs.get("grad_norm"), "kept": logs.get("pdmask/kept_frac"),
               "clipped": logs.get("clip_ratio/region_mean"), "time_step_s": self._dt}
        self.records.append(rec)
        _append(self._path, rec)
        self.print(self.line(rec, state.max_steps))

    def line(self, rec: dict, max_steps: int) -> str:
        """``step 3/24  reward 0.38  kept 0.91  heldout 0.42 @2 (step 0: 0.31)  12.3 s/step``."""
        parts = [f"step {rec['step']}/{max_steps}", f"reward {_fmt(rec['reward'])}"]
        if rec["kept"] is not None:
            parts.append(f"kept {rec['kept']:.2f}")
        elif rec["clipped"] is not None:
            parts.append(f"clipped {rec['clipped']:.2f}")
        h = self.heldout
        if h is not None and h.latest is not None:
            parts.append(f"heldout {h.latest['accuracy']:.2f} @{h.latest['step']} "
                         f"(step {h.first['step']}: {h.first['accuracy']:.2f})")
        parts.append(f"{_fmt(rec['time_step_s'], '.1f')} s/step")
        return "  ".join(parts)

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or not self.records:
            return
        dts = [r["time_step_s"] for r in self.records if r["time_step_s"] is not None]
        msg = f"done: {len(self.records)} steps, median {_fmt(statistics.median(dts) if dts else None, '.1f')} s/step"
        h = self.heldout
        if h is not None and h.latest is not None:
            msg += (f"; held-out accuracy {h.first['accuracy']:.3f} (step {h.first['step']}) -> "
                    f"{h.latest['accuracy']:.3f} (step {h.latest['step']}), {h.latest['n_prompts']} prompts")
        self.print(msg)


def heldout_callbacks(evaluate: Callable[[object], Mapping] | None, *, every: int,
                      print_fn: Callable[[str], None] = _print) -> list[TrainerCallback]:
    """``[StepLineCallback, HeldoutCallback]`` in this order (the line's step time then ends
    before the evaluation runs); only the line when ``evaluate`` is None."""
    if evaluate is None:
        return [StepLineCallback(print_fn=print_fn)]
    h = HeldoutCallback(evaluate, every=every)
    return [StepLineCallback(h, print_fn=print_fn), h]


__all__ = ["HELDOUT_FILE", "STEPS_FILE", "HeldoutCallback", "StepLineCallback", "check_result", "heldout_callbacks"]
