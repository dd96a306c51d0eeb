"""The batch step with a set of tokens left out: what masking those tokens changes.

Masking token t sets its term of the batch loss to zero (the aggregation's denominators
count it all the same: :func:`pdmask.loss.aggregate` divides by the response tokens,
not the kept ones). The batch loss is therefore a fixed linear combination of per-token
terms, ``L = sum_s c_s l_s`` with ``c_s`` the aggregation weight of token s
(``1 / N`` for token-mean), and the batch gradient without a set E is exactly
``G_{-E} = G - sum_{s in E} c_s grad l_s``. :class:`BatchStep` computes ``G`` once,
then replays the optimizer step (warm state, clipping, AdamW) from ``G_{-E}`` for any E:

    theta'_{-E} = step(optimizer_state, G - g_E)        g_E = grad sum_{s in E} c_s l_s

Each replay costs one forward + backward of the rows holding E (for ``g_E``), one
optimizer step and the forward that measures the result; the full batch's forward and
backward are paid once. Naive equivalent (what the tests compare with): two calls of
:func:`.steps.batch_step`, the second with ``A_s = 0`` for s in E (a zero advantage
zeroes a token's term, its gradient and nothing else), in float64.

The **own effect** of token t is
``dD_t(batch step) - dD_t(batch step without t) = D_t(theta') - D_t(theta'_{-t})``:
the part of the realized change at t that masking t removes. It depends on the
optimizer's state, so give ``optimizer_state`` of a run (``pdmask train`` run directory
or the audit's lag steps); a fresh AdamW's first step is sign-like and barely responds
to one token.

Everything runs on a float64 copy of the model (the caller's model is never touched):
one token's contribution to a step over thousands of tokens moves D by ~1e-7 relative,
far below float32 rounding of the logits.

API (also used by the batch-mask evaluation, :mod:`pdmask_lab.audit.phi`)::

    bs = BatchStep(model, forward, rb, advantages, cfg, optimizer_state=state)
    bs.D0                                   # (B, T) D at theta (float64)
    bs.divergence_after(exclude=None)       # (B, T) D after the full step
    bs.divergence_after(exclude=E, rows=r)  # (len(r), T) D after the step without E
    bs.after(exclude=E, measure=fn)         # fn(model) on the stepped float64 model
    bs.own_effect(tokens)                   # (n,) own effect of each (b, t) in tokens
"""

from __future__ import annotations

import torch

from .config import AuditConfig
from .steps import Forward, copy_in, optimizer_for, rollout_stats, step_loss, trainable

F64 = torch.float64


def rows_of(rb, rows: torch.Tensor):
    """The rollout batch restricted to ``rows`` (no column trimming: positions stay put)."""
    return rb[rows]


def aggregation_weights(response_mask: torch.Tensor, aggregation, dtype=F64) -> torch.Tensor:
    """(B, T) ``c_s = dL / dl_s``: the weight of each token's term in the loss aggregated
    with ``aggregation`` (a :class:`pdmask.Aggregation`, the loss spec's).

    :func:`pdmask.loss.aggregate` is linear in the per-token values with denominators
    that depend only on the response mask, so its gradient at any point is the weight.
    token-mean: ``1 / N``; seq-mean-token-mean: ``1 / (n_b * B')``; and so on."""
    from pdmask.loss import aggregate

    x = torch.zeros(response_mask.shape, dtype=dtype, requires_grad=True)
    (g,) = torch.autograd.grad(aggregate(x, response_mask, aggregation), x)
    return g


def _as_mask(exclude, shape) -> torch.Tensor | None:
    """``exclude``: None, a (B, T) bool mask or (n, 2) (b, t) indices -> (B, T) bool or None."""
    if exclude is None:
        return None
    if exclude.dtype == torch.bool:
        if tuple(exclude.shape) != tuple(shape):
            raise ValueError(f"exclude: a bool mask must have shape {tuple(shape)}, got {tuple(exclude.shape)}")
        return exclude if exclude.any() else None
    if exclude.dim() != 2 or exclude.shape[1] != 2:
        raise ValueError(f"exclude: expected a (B, T) bool mask or (n, 2) (b, t) indices, got {tuple(exclude.shape)}")
    m = torch.zeros(shape, dtype=torch.bool)
    if exclude.numel():
        m[exclude[:, 0].long(), exclude[:, 1].long()] = True
    return m if m.any() else None


class BatchStep:
    """The audit's batch step (``cfg``: the loss spec, optimizer, lr, clipping) on a
    float64 copy of ``model``, replayable with any set of tokens excluded.

    Args:
        model: the policy (copied to ``dtype``; never modified).
        forward: ``forward(model, sequences, attention_mask, prompt_len) -> (B, T, V)``.
        rb: the rollout batch (with ``logits`` when the divergence is a full one).
        advantages: (B, T) advantages (0 on padding).
        cfg: the audit's settings.
        optimizer_state: an ``optimizer.state_dict()`` to start every step from (copied
            per step, never changed); None: a fresh optimizer.
        dtype: the copy's dtype (float64 by default; see the module doc).
    """

    def __init__(self, model: torch.nn.Module, forward: Forward, rb, advantages: torch.Tensor, cfg: AuditConfig,
                 *, optimizer_state: dict | None = None, dtype: torch.dtype = F64):
        cfg.check_loss()  # a mode with an external batch direction is refused there
        if cfg.loss.corrections.is_batch_normalize:
            raise ValueError("loss.corrections.is_batch_normalize: the leave-one-out step replays the terms of row "
                             "slices, and a weight normalised over the batch makes a term depend on the other rows")
        if optimizer_state is not None and cfg.optimizer == "sgd":
            raise ValueError("optimizer_state: given with optimizer='sgd'; a saved state is an Adam(W) state")
        self.cfg, self.forward, self.rb, self.dtype = cfg, forward, rb, dtype
        self.A = advantages.to(dtype)  # (B, T)
        self.model = copy_in(model, dtype)
        self.model.eval()
        self.params = trainable(self.model)
        self.theta0 = [p.detach().clone() for p in self.params]
        self.state = optimizer_state
        self.shape = tuple(rb.response_mask.shape)  # (B, T)
        self.c = aggregation_weights(rb.response_mask.bool(), cfg.loss.aggregation, dtype)  # (B, T)
        logits = forward(self.model, rb.sequences, rb.attention_mask, rb.prompt_len)  # (B, T, V)
        out = step_loss(logits, rb, self.A, cfg)
        self.G = [g.detach() for g in torch.autograd.grad(out.loss, self.params, allow_unused=True)]
        self.G = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, self.G)]
        with torch.no_grad():
            self.D0 = rollout_stats(logits.detach(), rb, sampling=cfg.loss.sampling)[cfg.divergence]  # (B, T)
        self._full: torch.Tensor | None = None  # D after the full step, all rows (lazy)
        self.chunk = 16  # own_effect: tokens whose gradients are held at once

    # -------------------------------------------------------------- pieces
    def excluded_grad(self, exclude) -> list[torch.Tensor] | None:
        """``g_E = grad sum_{s in E} c_s l_s`` (one forward + backward of E's rows); None for E empty."""
        m = _as_mask(exclude, self.shape)
        if m is None:
            return None
        rows = m.any(1).nonzero().squeeze(1)
        sub = rows_of(self.rb, rows)
        logits = self.forward(self.model, sub.sequences, sub.attention_mask, sub.prompt_len)
        per = step_loss(logits, sub, self.A[rows], self.cfg).token_loss  # (R, T)
        w = torch.where(m[rows], self.c[rows], torch.zeros_like(self.c[rows]))
        grads = torch.autograd.grad((w * per).sum(), self.params, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(self.params, grads)]

    def _step(self, g_excluded) -> None:
        """theta <- step(state, G - g_E) on the copy (from theta0)."""
        cfg = self.cfg
        opt = optimizer_for(self.params, cfg, self.state)  # cast to the copy's dtype by torch
        with torch.no_grad():
            for i, (p, p0, G) in enumerate(zip(self.params, self.theta0, self.G)):
                p.copy_(p0)
                p.grad = G.clone() if g_excluded is None else G - g_excluded[i]
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
        opt.step()

    def _restore(self) -> None:
        with torch.no_grad():
            for p, p0 in zip(self.params, self.theta0):
                p.copy_(p0)
                p.grad = None

    # -------------------------------------------------------------- public
    def after(self, exclude=None, *, measure, g_excluded=None):
        """``measure(model)`` on the copy after the step without ``exclude`` (None: the
        full step; a (B, T) bool mask or (n, 2) indices). ``g_excluded``: a precomputed
        :meth:`excluded_grad` (then ``exclude`` is ignored). The copy is restored after."""
        g = g_excluded if g_excluded is not None else self.excluded_grad(exclude)
        try:
            self._step(g)
            with torch.no_grad():
                return measure(self.model)
        finally:
            self._restore()

    def _divergence(self, rows: torch.Tensor):
        def measure(model):
            sub = rows_of(self.rb, rows)
            logits = self.forward(model, sub.sequences, sub.attention_mask, sub.prompt_len)
            return rollout_stats(logits, sub, sampling=self.cfg.loss.sampling)[self.cfg.divergence]
        return measure

    def divergence_after(self, exclude=None, rows: torch.Tensor | None = None, *, g_excluded=None) -> torch.Tensor:
        """(R, T) float64 D after the step without ``exclude``, at the rows ``rows``
        (a LongTensor; None: every row)."""
        if exclude is None and g_excluded is None and self._full is not None:
            return self._full if rows is None else self._full[rows]
        rr = torch.arange(self.shape[0]) if rows is None else rows.long()
        out = self.after(exclude, measure=self._divergence(rr), g_excluded=g_excluded)
        if exclude is None and g_excluded is None and rows is None:
            self._full = out
        return out

    def own_effect(self, tokens: torch.Tensor) -> torch.Tensor:
        """(n,) ``D_t(theta') - D_t(theta'_{-t})`` for each ``(b, t)`` row of ``tokens`` (n, 2).
        ``self.after_full`` (n,) keeps ``D_t(theta')``.

        Cost per token: one backward of its row (the row's forward is shared by up to
        ``self.chunk`` of its tokens), one optimizer step, one forward of the row."""
        n = tokens.shape[0]
        out = torch.zeros(n, dtype=self.dtype)
        if n == 0:
            return out
        rows = tokens[:, 0].unique()
        full_rows = self.divergence_after(rows=rows)  # (R, T): the full step, only the rows needed
        pos = {int(b): i for i, b in enumerate(rows.tolist())}
        self.after_full = torch.stack([full_rows[pos[int(b)], int(t)] for b, t in tokens.tolist()])  # (n,)
        for b in rows.tolist():
            idx = (tokens[:, 0] == b).nonzero().squeeze(1).tolist()
            row = torch.tensor([b])
            sub = rows_of(self.rb, row)
            # the gradients of a chunk of the row's tokens first (one shared forward), then
            # the steps: a step changes the weights in place, which would invalidate the graph
            for s in range(0, len(idx), self.chunk):
                part = idx[s:s + self.chunk]
                logits = self.forward(self.model, sub.sequences, sub.attention_mask, sub.prompt_len)
                per = step_loss(logits, sub, self.A[row], self.cfg).token_loss[0]  # (T,)
                grads = []
                for j, i in enumerate(part):
                    t = int(tokens[i, 1])
                    gs = torch.autograd.grad(self.c[b, t] * per[t], self.params, allow_unused=True,
                                             retain_graph=j < len(part) - 1)
                    grads.append([torch.zeros_like(p) if x is None else x.detach() for p, x in zip(self.params, gs)])
                del logits, per
                for i, g in zip(part, grads):
                    t = int(tokens[i, 1])
                    out[i] = self.after_full[i] - self.divergence_after(rows=row, g_excluded=g)[0, t]
        return out
