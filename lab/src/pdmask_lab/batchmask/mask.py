"""The batch-aware predictive mask: :class:`BatchMask` and :func:`batch_mask`.

With ``O`` the out-of-region tokens (the core's proximity test on the model's logits),
``Phi(theta) = sum_{s in O} D_s(theta)`` and ``P`` the optimizer's preconditioner
(:mod:`.precondition`), the update made of token t's surrogate ``l_t = w_t A_t log pi_t``
alone changes Phi, to first order, by ``eta <grad Phi, P grad l_t> = eta c_t`` with::

    c_t = A_t w_t ddot_t,    ddot_t = <grad log pi_t, v>,    v = P grad_theta Phi

(P is symmetric). One backward gives v; one forward-mode pass gives every ddot_t
(:mod:`.directional`). A token is outward iff ``A_t ddot_t > 0`` (equivalently
``c_t > 0``, since ``w_t > 0``), and the keep mask drops

- ``scope="region"``: t in O with ``c_t > 0`` (gated like DPPO; mode ``pdm-batch-topk-*``);
- ``scope="all"``: any token with ``c_t > 0`` (mode ``pdm-batch-all-topk-*``).

Naive equivalent (per-token gradients; what the tests compare with)::

    v = P @ autograd.grad(Phi, theta)
    for t: c[t] = A[t] * w[t] * autograd.grad(log_pi[t], theta) @ v

Importing this module registers the ``pdm-batch-*`` modes (:func:`pdmask.register_mode`):
the core's divergence region and a direction the core does not compute, read from the
per-token extra :data:`DDOT` that :meth:`BatchMaskOutput.loss_kwargs` hands the loss
(``policy_loss(..., extras={DDOT: out.ddot})``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from pdmask._validate import check_choice, check_positive, prepare
from pdmask.keys import ESTIMATORS, ddot_key
from pdmask.masks import MODES, MaskMode, Thresholds, divergence_region, get_mode, register_mode, resolve_thresholds
from pdmask.ops import Compute, Sampling, rows_per_chunk
from pdmask.rollout import Rollout
from pdmask.stats import MAX_LOG_RATIO, token_stats
from pdmask.train.trainable import decoder_parts
from . import directional as dirl
from . import precondition as pre
from .params import select_params
from .phi import PHI_DIVERGENCES, out_of_region_divergence
from .top import TopCapture, jvp_top_logprob

#: The per-token extra the ``pdm-batch-*`` modes read: ``ddot_t = <grad log pi_t, P grad Phi>``.
DDOT = "ddot_batch"


def _direction(stats, estimator):
    return stats[DDOT]


for _scope in ("", "all-"):
    for _div in ("topk_kl", "topk_tv"):  # the default delta: the divergence's (the registry's)
        register_mode(MaskMode(
            f"pdm-batch-{_scope}{_div.replace('_', '-')}",
            divergence_region(_div) if not _scope else (lambda stats, adv, th: adv != 0),  # scope all: every token
            _direction, _div, needs=frozenset({"topk"}), extras=(DDOT,),
            supports=("topk+sampled",),  # the direction is built on the default support
            doc=f"batch-aware mask{', scope all' if _scope else ''}: {'any token' if _scope else _div + ' > delta'} "
                f"and A*{DDOT} > 0 (pdmask.batchmask)"))


def _broadcast(advantages, lead: tuple) -> torch.Tensor:
    if not isinstance(advantages, torch.Tensor) or not advantages.is_floating_point():
        raise ValueError("advantages: must be a floating-point torch.Tensor")
    if tuple(advantages.shape) == lead:
        return advantages
    if advantages.dim() == 1 and len(lead) == 2 and advantages.shape[0] == lead[0]:
        return advantages[:, None].expand(lead)
    raise ValueError(f"advantages: expected shape {lead} or ({lead[0]},), got {tuple(advantages.shape)}")


def _check_specs(thresholds, sampling) -> None:
    if thresholds is not None and not isinstance(thresholds, Thresholds):
        raise ValueError(f"thresholds: must be a pdmask.Thresholds (or None), got {type(thresholds).__name__}")
    if sampling is not None and not isinstance(sampling, Sampling):
        raise ValueError(f"sampling: must be a pdmask.Sampling (or None), got {type(sampling).__name__}")
    if sampling is not None and sampling.truncated:
        # the direction (out_of_region_divergence, the JVP of log pi) is built on the untruncated pi
        raise ValueError("sampling: the batch mask scores the untruncated pi; top_k / top_p / min_p are not available")


SCOPES = ("region", "all")
METHODS = ("auto", "jvp", "double-backward")


@dataclass
class BatchMaskOutput:
    """Everything detached. (B, T) tensors: ``mask`` (bool keep mask, True on padding),
    ``ddot`` (``<grad log pi_t, P grad Phi>``; 0 on padding), ``c`` (``A w ddot``: the
    first-order change of Phi per unit learning rate from token t's own update),
    ``out_of_region`` (bool, O). ``metrics``: dict of detached scalars. ``mode``,
    ``thresholds`` (resolved): the :func:`pdmask.policy_loss` settings that reproduce the
    mask (see :meth:`loss_kwargs`). ``method``: ``"jvp"``, ``"jvp-top"`` (forward mode
    through the top blocks only, ``params=N``) or ``"double-backward"``. ``logits``: with
    ``share_forward=True``, the (B, T, V) response logits of the forward the mask was
    computed on, differentiable with respect to every parameter of the model (the loss
    reuses that forward); otherwise None."""

    mask: torch.Tensor
    ddot: torch.Tensor
    c: torch.Tensor
    out_of_region: torch.Tensor
    metrics: dict
    mode: str
    thresholds: Thresholds
    method: str
    logits: torch.Tensor | None = None

    def loss_kwargs(self) -> dict:
        """Keyword arguments that make :func:`pdmask.policy_loss` apply this mask."""
        return {"mode": self.mode, "extras": {DDOT: self.ddot}, "thresholds": self.thresholds}


def batch_mode_settings(mode) -> tuple[str, str]:
    """``(divergence, scope)`` of a registered batch mode (a name or a :class:`pdmask.MaskMode`
    that needs the batch direction): read from the mode, not its name. ``scope`` is
    ``"region"`` when the mode's region is a divergence region, else ``"all"``."""
    mm = get_mode(mode)
    if DDOT not in mm.extras:
        raise ValueError(f"mode: {mm.name!r} does not take the batch direction; the batch modes are: "
                         f"{', '.join(n for n, m in MODES.items() if DDOT in m.extras)}")
    return mm.divergence, "region" if getattr(mm.region, "divergence", None) is not None else "all"


def batch_mode(divergence: str, scope: str):
    """The registered batch mode of ``divergence`` and ``scope`` (registry lookup)."""
    found = [m for n, m in MODES.items() if DDOT in m.extras and batch_mode_settings(m) == (divergence, scope)]
    if not found:
        raise ValueError(f"divergence: no batch mode is registered for {divergence!r} with scope {scope!r}")
    return found[0]


def _check_layout(input_ids, attention_mask, response_mask, validate: bool) -> int:
    for name, t in (("input_ids", input_ids), ("attention_mask", attention_mask),
                    ("rollout.response_mask", response_mask)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D torch.Tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids: must be an integer tensor of token ids, got dtype {input_ids.dtype}")
    B, L = input_ids.shape
    if tuple(attention_mask.shape) != (B, L):
        raise ValueError(f"attention_mask: expected shape {(B, L)} (same as input_ids), got {tuple(attention_mask.shape)}")
    T = response_mask.shape[1]
    if response_mask.shape[0] != B or not 1 <= T < L:
        raise ValueError(f"rollout.response_mask: expected shape ({B}, T) with 1 <= T < {L} (the response is the last T "
                         f"columns of input_ids, after at least one context token), got {tuple(response_mask.shape)}")
    if validate and bool((response_mask.bool() & ~attention_mask[:, L - T:].bool()).any()):
        raise ValueError("rollout.response_mask: marks a response token that attention_mask masks out")
    return T


class BatchMask:
    """The batch-aware mask for one model, parameter subset and optimizer.

    Args:
        model: causal LM (``torch.nn.Module``; see :mod:`.directional` for the call). Its
            forward must be deterministic (no active dropout) since it is run twice.
        params: ``"all"``, an int N (last N blocks + final norm + head) or a list of
            parameter names (:mod:`.params`).
        optimizer: None (P = I), or the ``torch.optim`` SGD / Adam / AdamW that will make
            the next step (its current state; :mod:`.precondition`).
        divergence: ``"topk_kl"`` or ``"topk_tv"``: the proximity divergence of O and Phi.
        estimator: the top-K tail estimator of the per-token ``Ddot`` the diagnostics
            compare with (``agree_pdm_frac``); c_t does not use it.
        thresholds: the region's :class:`pdmask.Thresholds` (None, or a None delta: the
            mode's, 0.05 for KL, 0.15 for TV); the mask reads their deltas only.
        scope: ``"region"`` (drop t in O with c_t > 0) or ``"all"`` (drop any c_t > 0).
        method: ``"auto"`` (forward mode; the double backward if an op of the model has no
            forward-mode derivative, decided once per instance), ``"jvp"`` or
            ``"double-backward"``. With ``params=N`` forward mode runs through the top
            blocks only (:mod:`.top`; the output's ``method`` is then ``"jvp-top"``).
        sampling: the engine's :class:`pdmask.Sampling`, ``pi = softmax(logits /
            temperature)`` (None: temperature 1); truncated sampling is refused (the
            direction is that of the untruncated pi).
        is_cap: IS cap C in ``w = min(r, C)`` (only scales c_t).
        chunk_size: rows per chunk of the vocabulary reductions.
        all_tokens: compute ``ddot`` (and ``c``) on every response token. By default, with
            ``scope="region"``, only the sequences holding an out-of-region token are
            differentiated when that is cheaper (:meth:`_rows`): the mask is the same,
            ``ddot`` and ``c`` are 0 on the other sequences (never used by the mask).
    """

    def __init__(self, model, *, params="all", optimizer=None, divergence: str = "topk_kl",
                 estimator: str = "exact", thresholds: Thresholds | None = None, scope: str = "region",
                 method: str = "auto", sampling: Sampling | None = None, is_cap: float = 5.0,
                 chunk_size: int | None = None, all_tokens: bool = False):
        check_choice("divergence", divergence, PHI_DIVERGENCES)
        if not isinstance(all_tokens, bool):
            raise ValueError(f"all_tokens: must be True or False, got {all_tokens!r}")
        check_choice("estimator", estimator, ESTIMATORS)
        check_choice("scope", scope, SCOPES)
        check_choice("method", method, METHODS)
        _check_specs(thresholds, sampling)
        check_positive("is_cap", is_cap, allow_inf=True)
        self.model, self.optimizer = model, optimizer
        self.subset = select_params(model, params)
        pre.check(optimizer, self.subset.params, [ns[0] for ns in self.subset.names])
        self.divergence, self.estimator, self.scope, self.method = divergence, estimator, scope, method
        self.mode = batch_mode(divergence, scope).name
        self.thresholds = resolve_thresholds(thresholds, get_mode(self.mode))
        # None: token_stats's default sampling, temperature 1
        self.sampling, self.temperature = sampling, 1.0 if sampling is None else sampling.temperature
        self.is_cap, self.chunk_size = is_cap, chunk_size
        self.all_tokens = all_tokens
        # the subset's share of the model's depth, for the cost rule of _rows
        self.depth_share = 1.0
        if self.subset.top is not None:
            blocks, _, _ = decoder_parts(model)
            self.depth_share = len(self.subset.top.blocks) / len(blocks)

    # ------------------------------------------------------------------ public
    def __call__(self, input_ids, attention_mask, rollout: Rollout, advantages, *, validate: bool = True,
                 share_forward: bool = False) -> BatchMaskOutput:
        """The mask of one batch (see :func:`batch_mask` for the arguments).

        ``share_forward=True``: the forward runs on the model's own parameters (the subset
        entering as views of them, :meth:`ParamSubset.aliases`) and its logits come back in
        ``out.logits`` with their graph, so a trainer computes its loss on them and saves
        one model forward::

            out = bm(..., share_forward=True)
            loss = policy_loss(out.logits, rollout, A, **out.loss_kwargs()).loss
            loss.backward()          # the ordinary gradient, through the same forward

        The mask and ``ddot`` are the same as without it (tested)."""
        if not isinstance(rollout, Rollout):
            raise ValueError(f"rollout: must be a pdmask.Rollout, got {type(rollout).__name__}")
        if rollout.response_mask is None:
            raise ValueError("rollout.response_mask: the batch mask needs it (the response is the last T columns "
                             "of input_ids)")
        T = _check_layout(input_ids, attention_mask, rollout.response_mask, validate)
        if rollout.topk_ids is None:
            raise ValueError(f"rollout.topk_ids: the batch mask needs the rollout top-K ids and log-probs "
                             f"(divergence {self.divergence!r})")
        ids = input_ids[:, input_ids.shape[1] - T:]
        data = (input_ids, attention_mask, rollout.replace(sampled_ids=ids, response_mask=rollout.response_mask.bool()),
                advantages, validate, share_forward)
        if self.method != "auto":
            return self._run(self.method, *data)
        try:
            out = self._run("jvp", *data)
            self.method = "jvp"
            return out
        except (NotImplementedError, RuntimeError) as err:
            if not dirl.is_missing_forward_ad(err):
                raise
            self.method = "double-backward"
            return self._run("double-backward", *data)

    # ------------------------------------------------------------------ steps
    def _run(self, method, input_ids, attention_mask, rollout, advantages, validate, share) -> BatchMaskOutput:
        sub, Tmp = self.subset, self.temperature
        ids = rollout.sampled_ids
        T = ids.shape[1]
        # shared: views of the live parameters (the loss's backward goes through them);
        # otherwise detached leaves, so nothing reaches the model's .grad
        leaves = sub.aliases() if share else [x.requires_grad_() for x in sub.leaves()]
        ctx = dirl.math_attention() if method == "double-backward" else contextlib.nullcontext()
        capture = TopCapture(sub.top.blocks) if method == "jvp" and sub.top is not None else None
        with torch.enable_grad(), ctx:
            try:
                logits = dirl.response_logits(self.model, sub.tensors(leaves, live=share), input_ids,
                                              attention_mask, T)  # (B, T, V)
            finally:
                if capture is not None:
                    capture.remove()
            st = token_stats(logits.detach(), rollout, sampling=self.sampling,
                             compute=Compute(chunk_rows=self.chunk_size), validate=validate)
            valid = st["valid"]
            adv = _broadcast(advantages, tuple(ids.shape)).to(st["log_ratio"].dtype)
            if validate and bool(torch.isnan(adv[valid]).any()):
                raise ValueError("advantages: contains NaN on response tokens")
            adv = torch.where(valid, adv, torch.zeros_like(adv))
            out = divergence_region(self.divergence)(st, adv, self.thresholds) & valid  # (B, T) O
            weight = out.to(st[self.divergence].dtype)
            phi_value = (st[self.divergence] * weight).sum()
            rows = self._rows(out)
            batch = rollout
            if rows is None:  # every sequence, on the forward above
                v, ddot, method = self._direction(method, leaves, logits, capture, input_ids, attention_mask, ids,
                                                  batch, weight, phi_value, valid, retain=share)
            else:
                ddot = torch.zeros_like(adv)
                v = [torch.zeros_like(x) for x in leaves]
                if rows.numel():  # the sequences holding O, on their own forward
                    own = [x.detach().requires_grad_() for x in sub.leaves()]
                    cap = TopCapture(sub.top.blocks) if method == "jvp" and sub.top is not None else None
                    try:
                        lg = dirl.response_logits(self.model, sub.tensors(own), input_ids[rows],
                                                  attention_mask[rows], T)  # (R, T, V)
                    finally:
                        if cap is not None:
                            cap.remove()
                    v, d, method = self._direction(method, own, lg, cap, input_ids[rows], attention_mask[rows],
                                                   ids[rows], batch[rows], weight[rows],
                                                   phi_value, valid[rows], retain=False)
                    ddot[rows] = d.to(ddot.dtype)
                    del lg
        ddot = torch.where(valid, ddot.to(adv.dtype), torch.zeros_like(adv))
        res = self._decide(st, adv, out, ddot, phi_value, v, method)
        res.metrics["num_direction_rows"] = torch.tensor(out.shape[0] if rows is None else rows.numel(),
                                                         device=valid.device)
        res.logits = logits if share else None
        return res

    def _rows(self, out: torch.Tensor) -> torch.Tensor | None:
        """The sequences whose ``ddot`` the mask needs, or None for all of them on the first forward.

        With ``scope="region"`` only tokens of O can be masked, and Phi involves only the
        sequences holding them, so the direction can be computed on those R of the B
        sequences, on their own forward. In model passes (depth share ``r`` of the subset:
        1 for all parameters, N / L for the last N blocks) that costs ``R/B (1 + 5r)``
        against ``5r`` for the backward of Phi and the forward-mode pass over the whole
        batch on the shared forward; the cheaper one is taken (a host sync per call)."""
        if self.scope != "region" or self.all_tokens:
            return None
        need = out.any(1)  # (B,)
        R, B = int(need.sum()), need.numel()
        r = self.depth_share
        if R and R / B * (1 + 5 * r) >= 5 * r:
            return None
        return need.nonzero().squeeze(1)

    def _direction(self, method, leaves, logits, capture, input_ids, attention_mask, ids, batch, weight,
                   phi_value, valid, *, retain: bool):
        """``v = P grad Phi`` and ``ddot = J v`` (R, T) from a forward's ``logits`` over ``leaves``."""
        sub, Tmp = self.subset, self.temperature
        b = prepare(tuple(logits.shape[:-1]), logits.shape[-1], logits.device, batch, validate=False)
        phi = out_of_region_divergence(
            logits.reshape(-1, logits.shape[-1]), phi_value, weight.reshape(-1), b.sampled_ids,
            b.sampled_logprob, b.topk_ids, b.topk_logprobs, divergence=self.divergence, temperature=Tmp,
            chunk_rows=rows_per_chunk(b.vocab_size, self.chunk_size, logits.device))
        grads = torch.autograd.grad(phi, leaves, retain_graph=retain or method == "double-backward",
                                    allow_unused=True)
        grads = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]
        v = pre.precondition_(self.optimizer, sub.params, [ns[0] for ns in sub.names], grads)
        del grads
        if method != "jvp":
            return v, dirl.double_backward_logprob(dirl.sampled_logprob(logits, ids, Tmp), leaves, v), method
        primals = [x.detach() for x in leaves]
        if capture is not None and capture.complete:
            ref = dirl.sampled_logprob(logits.detach(), ids, Tmp)
            ddot = jvp_top_logprob(sub, capture, primals, v, ids, Tmp, ref, valid)
            if ddot is not None:
                return v, ddot, "jvp-top"
        return v, dirl.jvp_logprob(self.model, sub, primals, v, input_ids, attention_mask, ids, Tmp), "jvp"

    def _decide(self, st, adv, out, ddot, phi_value, v, method) -> BatchMaskOutput:
        valid = st["valid"]
        max_log_w = min(math.log(self.is_cap), MAX_LOG_RATIO) if math.isfinite(self.is_cap) else MAX_LOG_RATIO
        w = st["log_ratio"].clamp(max=max_log_w).exp()
        c = adv * w * ddot
        outward = adv * ddot > 0
        drop = (out if self.scope == "region" else valid) & outward
        keep = ~drop
        n = valid.sum().clamp(min=1)
        n_out = out.sum()
        ratio_out = adv * st["log_ratio"] > 0
        pdm_out = adv * st[ddot_key(self.divergence, self.estimator)] > 0
        metrics = {
            "num_tokens": valid.sum(),
            "num_out_of_region": n_out,
            "out_of_region_frac": n_out / n,
            "num_masked": drop.sum(),
            "masked_frac": drop.sum() / n,
            "outward_frac_out_of_region": (out & outward).sum() / n_out.clamp(min=1),
            "agree_ratio_frac": (out & (ratio_out == outward)).sum() / n_out.clamp(min=1),
            "agree_pdm_frac": (out & (pdm_out == outward)).sum() / n_out.clamp(min=1),
            "phi": phi_value,
            "direction_norm": torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x.float()) for x in v])),
            "num_params": torch.tensor(self.subset.numel, device=valid.device),
        }
        return BatchMaskOutput(keep.detach(), ddot.detach(), c.detach(), out.detach(),
                               {k: t.detach() for k, t in metrics.items()}, self.mode, self.thresholds, method)


def batch_mask(model, input_ids, attention_mask, rollout: Rollout, advantages, *, params="all", optimizer=None, divergence: str = "topk_kl",
               estimator: str = "exact", thresholds: Thresholds | None = None, scope: str = "region",
               method: str = "auto", sampling: Sampling | None = None, is_cap: float = 5.0,
               chunk_size: int | None = None, validate: bool = True, all_tokens: bool = False) -> BatchMaskOutput:
    """The batch-aware predictive mask of one batch (:class:`BatchMask` for the settings).

    Args:
        model: causal LM; called on ``input_ids[:, :-1]`` (:mod:`.directional`).
        input_ids: (B, L) int: left-padded context + right-padded response; the response
            is the last T columns, and its tokens are the sampled ids.
        attention_mask: (B, L) real tokens.
        rollout: :class:`pdmask.Rollout`: ``response_mask`` (B, T) the response tokens to
            score, ``sampled_logprob`` (B, T) ``log mu_k`` (engine, at ``sampling``'s temperature),
            ``topk_ids`` / ``topk_logprobs`` (B, T, K) the engine's top-K of mu; its
            ``sampled_ids`` are replaced by the last T columns of ``input_ids``.
        advantages: (B, T) or (B,).
        validate: check inputs (host syncs); off on a trusted hot path.

    Returns :class:`BatchMaskOutput`; ``policy_loss(logits, rollout, A, **out.loss_kwargs())``
    applies the mask (same logits, i.e. the same parameters).
    """
    bm = BatchMask(model, params=params, optimizer=optimizer, divergence=divergence, estimator=estimator,
                   thresholds=thresholds, scope=scope, method=method, sampling=sampling, is_cap=is_cap,
                   chunk_size=chunk_size, all_tokens=all_tokens)
    return bm(input_ids, attention_mask, rollout, advantages, validate=validate)
