"""The updates whose realized divergence change the audit measures.

Three kinds of step, each followed by recomputing the proximity divergence with the
*same* rollout view of mu (METHOD.md section 5):

- :func:`batch_step`: one optimizer step of the configured loss on the whole batch,
  as training does (cross-token interference, optimizer preconditioning).
- :func:`isolated_param_changes`: for chosen tokens, a small step in parameter space
  along the gradient of that token's loss alone, ``-w A log pi_k`` (normalised to a
  fixed length, so every token's step is equally "small"); weights restored after each.
  This is the first-order claim as seen through the network (its Jacobian couples
  tokens), in float64 by default so rounding cannot flip a sign.
- :func:`logit_step_changes`: the step ``z -> z + eta sign(A) (e_k - pi) / |e_k - pi|``
  directly on one position's logits, which is the literal first-order claim (the
  unembedding gradient moves the logits exactly along ``e_k - pi``).

The model is passed with a ``forward(model, sequences, attention_mask, prompt_len)``
callable returning the (B, T, V) logits at the response positions, so any policy
(a transformers causal LM, a softmax bandit) can be audited. Every function leaves
the model's weights exactly as it found them.
"""

from __future__ import annotations

import copy
import math
from typing import Callable

import torch

from pdmask._validate import check_choice
from pdmask.loss import PolicyLossOutput
from pdmask.ops import Sampling
from pdmask.rollout import Rollout
from pdmask.stats import token_stats
from pdmask.train.update import build_optimizer
from .config import AuditConfig

Forward = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, int], torch.Tensor]


def _rms_norm_in_input_dtype(self, hidden_states: torch.Tensor) -> torch.Tensor:
    var = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(var + self.variance_epsilon))


def copy_in(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``model`` in ``dtype`` that really computes in it.

    transformers' RMSNorm (Llama, Qwen3, Mistral, ...) casts its input to float32 and back,
    so a float64 copy would still round every normalised hidden state to float32: the
    finite differences and leave-one-out steps of the audit, which resolve changes far
    below float32 rounding, would read that rounding. In a float64 copy every module
    with an RMSNorm's shape (``weight``, ``variance_epsilon``, a float32 upcast) computes
    in float64 instead; the function is the same, the precision is the copy's."""
    m = copy.deepcopy(model).to(dtype)
    if dtype == torch.float64:
        import types
        for mod in m.modules():
            if type(mod).__name__.endswith("RMSNorm") and hasattr(mod, "variance_epsilon") and hasattr(mod, "weight"):
                mod.forward = types.MethodType(_rms_norm_in_input_dtype, mod)
    return m


def trainable(model: torch.nn.Module) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model: has no parameter with requires_grad=True; nothing to step")
    return params


def optimizer_for(params, cfg: AuditConfig, state: dict | None = None) -> torch.optim.Optimizer:
    """The batch step's optimizer (:func:`pdmask.train.update.build_optimizer` with the
    audit's settings): fresh, as at the first step of training, or holding a copy of
    ``state``'s moments with the audit's hyperparameters."""
    return build_optimizer(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas, kind=cfg.optimizer,
                           state=state)


def rollout_stats(logits: torch.Tensor, rb, rows=slice(None), *, sampling: Sampling) -> dict:
    """:func:`pdmask.token_stats` of ``logits`` against the batch's rollout view (top-K + full
    logits), at the loss spec's ``sampling`` (``cfg.loss.sampling``)."""
    return token_stats(logits, rb.rollout[rows], sampling=sampling)


def step_loss(logits: torch.Tensor, rb, advantages: torch.Tensor, cfg: AuditConfig) -> PolicyLossOutput:
    """The batch step's loss: ``cfg.loss``, the trainer's whole loss spec with the step mode.

    Its ``token_loss`` (B, T) holds each token's term before aggregation; a term depends
    on its own sequence only (the step modes are per-token, the corrections per token or
    per sequence; a weight normalised over the batch is refused where rows are sliced,
    :class:`.loo.BatchStep`), so a slice of rows gives the same terms as the whole batch."""
    return cfg.loss(logits, rb.rollout, advantages)


def batch_step(model: torch.nn.Module, forward: Forward, rb, advantages: torch.Tensor,
               cfg: AuditConfig, *, optimizer_state: dict | None = None
               ) -> tuple[torch.Tensor, PolicyLossOutput, torch.Tensor]:
    """One optimizer step of ``policy_loss(mode=cfg.step_mode)`` on the whole batch.

    The optimizer is fresh (as at the first step of training) unless ``optimizer_state``
    (an ``optimizer.state_dict()`` of the same optimizer class over the same trainable
    parameters, e.g. from a training checkpoint) is given; it is copied, never changed.
    Gradients are clipped to ``cfg.grad_clip`` (global norm; 0: off) as the trainer does.

    Returns ``(logits_before, loss output (at theta), logits_after)``, both logits
    (B, T, V) detached in the model's dtype. The weights are restored afterwards.
    """
    params = trainable(model)
    saved = [p.detach().clone() for p in params]
    opt = optimizer_for(params, cfg, optimizer_state)
    try:
        logits = forward(model, rb.sequences, rb.attention_mask, rb.prompt_len)
        out = step_loss(logits, rb, advantages, cfg)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        with torch.no_grad():
            after = forward(model, rb.sequences, rb.attention_mask, rb.prompt_len)
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
                p.grad = None
    return logits.detach(), out, after.detach()


def _is_weight(log_ratio: torch.Tensor, is_cap: float) -> torch.Tensor:
    cap = math.log(is_cap) if math.isfinite(is_cap) else 50.0
    return log_ratio.detach().clamp(max=cap).exp()


def step_params(model: torch.nn.Module, which: str) -> list[torch.Tensor]:
    """Parameters an isolated step moves: ``all`` trainable ones, or the ``head`` (output embedding)."""
    if which == "all":
        return trainable(model)
    if which == "head":
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is None:
            raise ValueError("isolated_params: 'head' needs a model with get_output_embeddings() (a transformers LM)")
        return [p for p in head.parameters() if p.requires_grad]
    check_choice("isolated_params", which, ("all", "head"))


def isolated_param_changes(model: torch.nn.Module, forward: Forward, rb, advantages: torch.Tensor,
                           tokens: torch.Tensor, cfg: AuditConfig, *, params: str = "all") -> torch.Tensor:
    """Realized ``dD`` (n,) of an isolated parameter step on each token in ``tokens`` (n, 2) = (b, t).

    For token (b, t): ``g = grad_theta (-w A log pi_k)`` on sequence b alone,
    ``theta' = theta - eta g / |g|`` with ``eta = cfg.isolated_step``, then
    ``dD = D_t(theta') - D_t(theta)``; theta restored. ``params`` chooses theta (see
    :func:`step_params`). The model is copied to ``cfg.isolated_dtype`` first (the
    caller's model is never touched). A token whose gradient is exactly zero gets ``dD = 0``.
    """
    dD = torch.zeros(tokens.shape[0], dtype=torch.float64)
    if tokens.shape[0] == 0:
        return dD
    dtype = getattr(torch, cfg.isolated_dtype)
    m = copy_in(model, dtype)
    params = step_params(m, params)
    saved = [p.detach().clone() for p in params]
    div, sampling, is_cap = cfg.divergence, cfg.loss.sampling, cfg.loss.corrections.is_cap
    for b in tokens[:, 0].unique().tolist():
        rows = slice(b, b + 1)
        which = (tokens[:, 0] == b).nonzero().squeeze(1).tolist()
        seq, am = rb.sequences[rows], rb.attention_mask[rows]
        for i in which:
            # A fresh forward per token: the in-place step + restore below would
            # invalidate a graph shared between tokens (and keeping n gradients instead
            # would cost n copies of the model).
            st = rollout_stats(forward(m, seq, am, rb.prompt_len), rb, rows, sampling=sampling)  # (1, T) each
            t = int(tokens[i, 1])
            a = advantages[b, t].to(dtype)
            loss = -_is_weight(st["log_ratio"][0, t], is_cap) * a * st["logp"][0, t]
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
            gnorm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
            if gnorm == 0:
                continue
            with torch.no_grad():
                for p, g in zip(params, grads):
                    p.sub_((cfg.isolated_step / gnorm).to(dtype) * g)
                d1 = rollout_stats(forward(m, seq, am, rb.prompt_len), rb, rows, sampling=sampling)[div][0, t]
                dD[i] = (d1.double() - st[div][0, t].detach().double())
                for p, s in zip(params, saved):
                    p.copy_(s)
    return dD


@torch.no_grad()
def logit_step_changes(logits: torch.Tensor, rollout: Rollout, advantages: torch.Tensor, *, divergence: str,
                       step: float, temperature: float = 1.0) -> torch.Tensor:
    """Realized ``dD`` (N,) of the step ``z -> z + eta sign(A) (e_k - pi) / |e_k - pi|`` per row, in float64.

    ``z = logits / T``; rows are independent positions (N, V). To first order
    ``dD = eta sign(A) Ddot / |e_k - pi|``, so its sign is the predictive direction.
    ``rollout``: (N,) rows with the top-K and the rollout's full ``logits`` (N, V).
    """
    f64 = torch.float64
    sampled_ids, rollout_logits = rollout.sampled_ids, rollout.logits
    if logits.shape[0] == 0:  # no token to step (token_stats needs at least one row)
        return torch.zeros(0, dtype=f64)
    z = logits.to(f64) / temperature  # (N, V)
    pi = torch.softmax(z, -1)
    u = -pi
    u.scatter_add_(1, sampled_ids[:, None].long(), torch.ones_like(u[:, :1]))
    u = u / u.norm(dim=-1, keepdim=True).clamp(min=torch.finfo(f64).tiny)
    z2 = z + step * torch.sign(advantages.to(f64))[:, None] * u
    mu_z = rollout_logits.to(f64) / temperature

    def D(zz):
        r = rollout.replace(sampled_logprob=rollout.sampled_logprob.to(f64),
                            topk_logprobs=rollout.topk_logprobs.to(f64), logits=mu_z)
        return token_stats(zz, r)[divergence]

    return D(z2) - D(z)
