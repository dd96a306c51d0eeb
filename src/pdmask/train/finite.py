"""The built-in trainer's stop at the first non-finite loss, gradient norm or weight.

A diverging run (a learning rate too large, an overflow) used to log ``null`` losses and
die steps later in sampling, far from its cause. The loop now watches every mini-batch and
ends the run at the step where one of the three first stops being finite:

- :func:`watch` -- one mini-batch's loss, its pre-clip gradient norm and whether every
  trained weight is finite after its update, kept on the device (no host sync);
- :func:`first_nonfinite` -- the step's watches read back with one host sync: the first
  mini-batch where one of the three is not finite, as a JSON-safe record (None: all finite);
- :func:`stop` -- that record written into the run's records (the step's ``metrics.jsonl``
  record under ``nonfinite``, ``summary.json`` under ``stopped``), then :class:`NonFinite`
  raised: one line naming the step and the values, and what to change.

Naive equivalent, after every optimizer step::

    if not (math.isfinite(loss.item()) and math.isfinite(grad_norm.item())
            and all(p.isfinite().all() for p in params)):
        raise ...

(a host sync per mini-batch; here one per step, where the step's metrics are read anyway).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Callable, NoReturn

import torch

from .logging import read_jsonl
from .rundir import writing


class NonFinite(ValueError):
    """A run stopped at a non-finite loss, gradient norm or weight; the message is one line
    (the step, the values, what to change) and ``record`` what the run's records hold."""

    def __init__(self, message: str, record: dict):
        super().__init__(message)
        self.record = record


@dataclass
class Watch:
    """One mini-batch: its loss and pre-clip gradient norm (0-dim, detached), and whether
    every trained weight was finite after its update (0-dim bool)."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    weights_finite: torch.Tensor


def trained_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters the optimizer updates (frozen ones cannot turn non-finite)."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def watch(loss: torch.Tensor, grad_norm: torch.Tensor, params: list[torch.Tensor]) -> Watch:
    """The mini-batch's :class:`Watch`, taken after its optimizer step (no host sync)."""
    dev = loss.device
    ok = torch.stack([torch.isfinite(p).all().to(dev) for p in params]).all() if params \
        else torch.ones((), dtype=torch.bool, device=dev)
    return Watch(loss.detach().float().reshape(()), grad_norm.detach().float().reshape(()).to(dev), ok)


def _value(x: float) -> float | str:
    """A number as JSON holds it: non-finite ones as the strings 'nan', 'inf', '-inf'."""
    return x if math.isfinite(x) else str(x)


def first_nonfinite(watched: list[Watch]) -> dict | None:
    """The first watched mini-batch where the loss, the gradient norm or a weight is not
    finite (one host sync for the whole step): ``{"minibatch": j (1-based), "of": n,
    "loss", "grad_norm", "weights": "finite" | "non-finite"}``; None when all are finite."""
    if not watched:
        return None
    rows = torch.stack([torch.stack([w.loss, w.grad_norm, w.weights_finite.float()]) for w in watched]).tolist()
    for j, (loss, gn, ok) in enumerate(rows):
        if not (math.isfinite(loss) and math.isfinite(gn) and ok):
            return {"minibatch": j + 1, "of": len(rows), "loss": _value(loss), "grad_norm": _value(gn),
                    "weights": "finite" if ok else "non-finite"}
    return None


def nonfinite_weights(params: list[torch.Tensor], names: dict[int, str]) -> dict:
    """How many trained weights are not finite now, of how many, and the first parameter
    holding one (by ``names``: ``id(param) -> name``)."""
    bad = [(names.get(id(p), "?"), int((~torch.isfinite(p)).sum())) for p in params]
    first = next((n for n, k in bad if k), None)
    return {"nonfinite_weights": sum(k for _, k in bad), "weights": sum(p.numel() for p in params),
            "first_nonfinite_parameter": first}


def advice(found: dict, lr: float, grad_clip: float) -> str:
    """What to change, from where the run went non-finite."""
    tip = f"lower lr (now {lr:g})"
    if grad_clip <= 0:
        tip += ", or clip the gradient (grad_clip > 0; now off)"
    if isinstance(found["loss"], str) and found["minibatch"] == 1:  # the step began with finite weights
        tip += "; a loss that is non-finite on finite weights can also be the model's precision (dtype)"
    return tip


def describe(step: int, found: dict) -> str:
    """Where the run went non-finite, and the values, as one clause."""
    what = [k for k in ("loss", "grad_norm") if isinstance(found[k], str)]
    if found["weights"] != "finite":
        what.append("weights")
    now = (f"{found['nonfinite_weights']} of {found['weights_total']} weights non-finite after the step, first in "
           f"{found['first_nonfinite_parameter']}") if found.get("nonfinite_weights") else "weights finite"
    def num(v):
        return f"{v:.4g}" if isinstance(v, float) else v

    return (f"step {step}: the run went non-finite ({', '.join(what)}) at mini-batch {found['minibatch']} of "
            f"{found['of']}: loss {num(found['loss'])}, grad_norm {num(found['grad_norm'])}, {now}")


def stop(step: int, record: dict, found: dict, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         log, run_dir, cfg, summarize: Callable[[list[dict]], dict]) -> NoReturn:
    """Write where the run went non-finite into its records and raise :class:`NonFinite`.

    ``record``: the step's metrics record (logged with ``nonfinite`` added, its non-finite
    values as null, as any record's); ``summarize``: records -> the run's summary (written
    to ``summary.json`` with ``stopped``). No checkpoint is written for this step: a resume
    continues from the last finite one."""
    params = trained_parameters(optimizer)
    counts = nonfinite_weights(params, {id(p): n for n, p in model.named_parameters()})
    found = {**found, "nonfinite_weights": counts["nonfinite_weights"], "weights_total": counts["weights"],
             "first_nonfinite_parameter": counts["first_nonfinite_parameter"]}
    tip = advice(found, cfg.lr, cfg.grad_clip)
    stopped = {"step": step, **found, "advice": tip}
    log.log({"step": step, **record, "nonfinite": stopped})
    log.close()
    summary = summarize(read_jsonl(run_dir / "metrics.jsonl"))
    summary["stopped"] = stopped
    with writing(run_dir / "summary.json"):
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    raise NonFinite(f"{describe(step, found)}; stopped, the values are in the run's metrics.jsonl and summary.json "
                    f"({run_dir}); {tip}", stopped)
