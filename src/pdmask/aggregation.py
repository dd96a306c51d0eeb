"""Aggregation: how per-token losses reduce to a scalar (verl 0.9.1's ``agg_loss`` modes).

:class:`Aggregation` (the spec, checked once) and :func:`aggregate` (the reduction). Split
out of :mod:`pdmask.loss`, which re-exports both; the verl plugin and the built-in trainer
build one :class:`Aggregation` each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._validate import LOSS_AGG_READS, LOSS_AGGS, Checks, check_choice, check_count


# ------------------------------------------------------------------ aggregation
#: The denominators of :class:`Aggregation` (each None, a positive number or a 0-d tensor).
COUNTS = ("num_tokens", "num_seqs", "loss_scale_factor")


@dataclass(frozen=True)
class Aggregation:
    """How per-token losses reduce to a scalar: verl 0.9.1's ``agg_loss``, every mode and
    argument (:func:`aggregate`).

    ``loss_agg``: ``token-mean``, ``token-sum``, ``seq-mean-token-mean``,
    ``seq-mean-token-sum``, ``seq-mean-token-sum-norm``. ``num_tokens`` (token-mean) /
    ``num_seqs`` (the seq-mean modes) replace the local denominators by global counts
    (data parallelism, gradient accumulation; verl's ``batch_num_tokens`` /
    ``global_batch_size``), ``loss_scale_factor`` the ``-norm`` mode's T; each None, a
    positive finite number or a one-element real tensor holding one (a tensor's value is
    checked with the call's data checks). A denominator the mode does not read is refused
    (:data:`pdmask._validate.LOSS_AGG_READS`). ``dp_size`` (a positive int, verl's) multiplies
    the loss, so that the data-parallel average of the ranks' gradients is the gradient of
    the global aggregate; with ``dp_size > 1`` the mode's global count is required (a local
    count times ``dp_size`` would weigh each rank by its own size). Checked here, once.
    """

    loss_agg: str = "token-mean"
    num_tokens: object = None
    num_seqs: object = None
    loss_scale_factor: object = None
    dp_size: int = 1

    def __post_init__(self) -> None:
        check_choice("loss_agg", self.loss_agg, LOSS_AGGS)
        for name in COUNTS:
            check_count(name, getattr(self, name))
        reads = LOSS_AGG_READS[self.loss_agg]
        for name in COUNTS:
            if getattr(self, name) is not None and name not in reads:
                readers = [a for a, r in LOSS_AGG_READS.items() if name in r]
                raise ValueError(f"{name}: {self.loss_agg} does not read it (read by: {', '.join(readers)}); "
                                 "leave it None")
        dp = self.dp_size
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise ValueError(f"dp_size: must be a positive int (the data-parallel world size), got {dp!r}")
        if dp > 1 and reads and getattr(self, reads[0]) is None:
            raise ValueError(f"{reads[0]}: required when dp_size > 1 (got dp_size={dp}): {self.loss_agg} then "
                             "divides by the global count, which no rank can see locally")

    def check_values(self, checks: Checks) -> None:
        """The values of tensor denominators, into ``checks`` (no sync here)."""
        for name in COUNTS:
            check_count(name, getattr(self, name), checks)


def aggregate(
    token_values: torch.Tensor,  # (B, T)
    response_mask: torch.Tensor,  # (B, T)
    aggregation: Aggregation | None = None,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """Reduce per-token values to a scalar with verl's aggregation modes.

    With ``m`` the mask, ``S_b = sum_t x_bt m_bt``, ``n_b = sum_t m_bt`` and ``D`` the
    ``dp_size``:

    - ``token-mean``: ``D sum_b S_b / sum_b n_b`` (every token weighs the same; DAPO).
    - ``token-sum``: ``D sum_b S_b``.
    - ``seq-mean-token-mean``: ``D`` times the mean over sequences with ``n_b > 0`` of
      ``S_b / n_b`` (original GRPO). Here ``n_b`` exactly (``n_b >= 1`` on every counted
      sequence); verl's ``agg_loss`` divides by ``n_b + 1e-8``, which for verl's bool mask is
      a float32 that rounds back to ``n_b`` (the same number) and for a float64 mask differs
      by at most ``1e-8`` relative.
    - ``seq-mean-token-sum``: ``D`` times the mean over sequences with ``n_b > 0`` of ``S_b``.
    - ``seq-mean-token-sum-norm``: ``seq-mean-token-sum / loss_scale_factor``, the
      factor defaulting to the padded length T (Dr. GRPO; set it to a constant such as
      the max response length so the scale does not move with the batch).

    ``aggregation`` (:class:`Aggregation`; None: token-mean) names the mode and the
    denominators; given ones (``sum_b n_b`` by ``num_tokens``, the number of sequences by
    ``num_seqs``) are used as they are (a tensor's value is checked with a host sync unless
    ``validate=False``). Padding is excluded with ``where``, so NaN/inf in padded positions
    cannot leak. Empty batches give 0 (with the local counts).
    Naive torch (token-mean): ``(x * m).sum() / m.sum() * dp_size``.
    """
    agg = Aggregation() if aggregation is None else aggregation
    if not isinstance(agg, Aggregation):
        raise ValueError(f"aggregation: must be a pdmask.Aggregation, got {type(agg).__name__}")
    if validate:
        checks = Checks()
        agg.check_values(checks)
        checks.run()
    num_tokens, num_seqs, loss_scale_factor, dp = agg.num_tokens, agg.num_seqs, agg.loss_scale_factor, agg.dp_size
    if token_values.dim() == 1:
        token_values, response_mask = token_values[None], response_mask[None]
    m = response_mask.bool()
    x = torch.where(m, token_values, torch.zeros_like(token_values))
    # verl's order of operations (sum / count * dp_size, then / loss_scale_factor), so the
    # two agree to the last bit where the sums do
    if agg.loss_agg == "token-sum":
        return x.sum() * dp
    if agg.loss_agg == "token-mean":
        den = _clamp1(m.sum(), x) if num_tokens is None else _given(num_tokens, x)
        return x.sum() / den * dp
    n_b = m.sum(-1)
    seq_ok = n_b > 0
    den = _clamp1(seq_ok.sum(), x) if num_seqs is None else _given(num_seqs, x)
    if agg.loss_agg == "seq-mean-token-mean":
        per_seq = x.sum(-1) / n_b.clamp(min=1).to(x.dtype)
        return per_seq.sum() / den * dp
    out = x.sum() / den * dp
    if agg.loss_agg == "seq-mean-token-sum-norm":
        scale = token_values.shape[-1] if loss_scale_factor is None else loss_scale_factor
        out = out / scale
    return out


def _clamp1(den, like: torch.Tensor):
    if isinstance(den, torch.Tensor):
        return den.to(like.dtype).clamp(min=1)
    return max(float(den), 1.0)


def _given(den, like: torch.Tensor):
    """A user-given (checked, positive) denominator, used as it is."""
    if isinstance(den, torch.Tensor):
        return den.detach().reshape(()).to(like.dtype)
    return float(den)
