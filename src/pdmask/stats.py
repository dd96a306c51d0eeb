"""Per-token statistics: :class:`TokenStats`, the one contract between :mod:`pdmask.ops` and
everything above it; :func:`token_stats` its one producer, :meth:`TokenStats.from_logprobs`
the adapter for log-probs alone (verl), :func:`pdmask.loss.loss_from_stats` its one consumer.
Naive torch of the binary part: ``logp = log_softmax(logits / T, -1).gather(-1, k[..., None])``,
``log_ratio = logp - rollout.sampled_logprob``, ``binary_tv = |exp(logp) - exp(sampled_logprob)|``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from functools import cached_property

import torch

from . import divergences as dv
from . import ops
from ._validate import Checks, SpecError, check_choice, prepare
from .keys import DDOT_KEY, SUPPORTS, TOPK_DDOTS, TOPK_DIVERGENCES
from .rollout import Rollout

#: Cap on every exponentiated log-ratio: ``r = exp(min(log r, MAX_LOG_RATIO))`` in the
#: ``ratio`` statistic, the IS weight ``min(r, C)`` and the PPO ratio of the loss
#: (exp(50) ~ 5e21: finite in float32 even times an advantage and a floored log pi_k).
MAX_LOG_RATIO = 50.0


def capped_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """``r = exp(min(log r, MAX_LOG_RATIO))``."""
    return log_ratio.clamp(max=MAX_LOG_RATIO).exp()


def _tensors(obj) -> dict[str, torch.Tensor]:
    """A part's tensors by stat name (a top-K part's ``values`` by their divergence's name)."""
    out = dict(obj.values) if isinstance(obj, TopKStats) else {}
    out.update({f.name: getattr(obj, f.name) for f in fields(obj) if isinstance(getattr(obj, f.name), torch.Tensor)})
    return out


@dataclass(frozen=True, eq=False)
class TopKStats:
    """The top-K part: ``values``, every registered top-K divergence (``topk_kl``, ``topk_tv``,
    ..., :data:`pdmask.keys.TOPK_DIVERGENCES`) on the support ``S'`` with one tail bucket, by
    name (also read as attributes: ``part.topk_kl``); ``rollout_tail_mass`` (mu_T),
    ``policy_tail_mass`` (pi_T), ``tail_clamped`` (sum of mu on the support exceeded 1 by
    rounding), ``sampled_in_topk``. :meth:`ddot` is computed from ``support`` when first read
    (a mode reads one of them); a part made elsewhere (:meth:`from_dict`) carries the ones it
    was given."""

    values: Mapping[str, torch.Tensor]
    rollout_tail_mass: torch.Tensor
    policy_tail_mass: torch.Tensor
    tail_clamped: torch.Tensor
    sampled_in_topk: torch.Tensor
    support: dv.Support | None = field(default=None, repr=False)
    ddots: dict = field(default_factory=dict, repr=False)

    def __getattr__(self, name: str) -> torch.Tensor:
        values = self.__dict__.get("values") or {}
        if name in values:
            return values[name]
        raise AttributeError(name)

    def ddot(self, divergence: str, estimator: str = "exact") -> torch.Tensor:
        """``Ddot`` of a registered top-K divergence with a tail estimator (:data:`pdmask.ESTIMATORS`)."""
        key = DDOT_KEY[divergence, estimator]
        if key not in self.ddots:
            if self.support is None:
                raise KeyError(key)
            shape = self.rollout_tail_mass.shape
            self.ddots[key] = dv.ddot_topk(self.support, divergence, estimator).reshape(shape)
        return self.ddots[key]

    def names(self) -> list[str]:
        return [k for k in topk_names() if k not in TOPK_DDOTS or self.support is not None or k in self.ddots]

    def to_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of the part by its stat name, each ``Ddot`` computed (to ship it)."""
        return {k: self.ddot(*TOPK_DDOTS[k]) if k in TOPK_DDOTS else _tensors(self)[k] for k in self.names()}

    @classmethod
    def from_dict(cls, d: Mapping[str, torch.Tensor]) -> "TopKStats":
        """The part from :meth:`to_dict`'s entries (the ``Ddot`` ones that are there)."""
        missing = [k for k in topk_names() if k not in d and k not in TOPK_DDOTS]
        if missing:
            raise SpecError("stats", f"missing the top-K statistics {', '.join(map(repr, missing))}")
        return cls({k: d[k] for k in TOPK_DIVERGENCES}, **{k: d[k] for k in TOPK_FIELDS},
                   ddots={k: d[k] for k in TOPK_DDOTS if k in d})


#: the tensor fields of a top-K part besides its divergences' values
TOPK_FIELDS = tuple(f.name for f in fields(TopKStats) if f.name not in ("values", "support", "ddots"))


def topk_names() -> tuple[str, ...]:
    """The stat names of a top-K part: the registered divergences' values, the part's other
    tensors, then every ``Ddot`` (what a plugin ships); read from the registry when called."""
    return (*TOPK_DIVERGENCES, *TOPK_FIELDS, *TOPK_DDOTS)


def __getattr__(name: str):
    if name == "TOPK_NAMES":  # the names as of now (a registration changes them): topk_names()
        return topk_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True, eq=False)
class FullStats:
    """The full-vocabulary part (the rollout's full logits given: simulation / oracle)."""

    full_kl: torch.Tensor
    full_tv: torch.Tensor
    ddot_full_kl: torch.Tensor
    ddot_full_tv: torch.Tensor


@dataclass(frozen=True, eq=False)
class KeptStats:
    """The kept-set part (truncated sampling): ``kept_mass`` = pi(S) of the full-vocabulary
    pi, ``kept_size`` = |S|, ``sampled_outside`` (bool: the trainer's rule drops the sampled
    token), with top-K ``kept_topk_mismatch`` (share of top-K entries whose membership differs
    between the engine's set and the trainer's)."""

    kept_mass: torch.Tensor
    kept_size: torch.Tensor
    sampled_outside: torch.Tensor
    kept_topk_mismatch: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class TokenStats(Mapping):
    """Every per-token statistic of one batch, shaped like the rollout's ids: ``logp`` (log pi_k,
    the one differentiable tensor), ``sampled_logprob`` (log mu_k), ``log_ratio``, ``ratio``
    (capped), ``entropy``, ``sum_p2``, ``binary_tv``, ``binary_kl`` and their ``Ddot =
    grad_{z/T} D . (e_k - pi)``, ``valid``; parts ``topk``, ``full``, ``kept``; ``extras``.
    It also reads as a mapping from stat names (these fields, the top-K ``Ddot`` names of
    :func:`pdmask.ddot_key`, the extras) to tensors: the audit, the plugins and the modes
    name statistics by computed keys, and the names are the fields, written nowhere else."""

    logp: torch.Tensor
    sampled_logprob: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    entropy: torch.Tensor
    sum_p2: torch.Tensor
    binary_tv: torch.Tensor
    binary_kl: torch.Tensor
    ddot_binary_tv: torch.Tensor
    ddot_binary_kl: torch.Tensor
    valid: torch.Tensor
    topk: TopKStats | None = None
    full: FullStats | None = None
    kept: KeptStats | None = None
    extras: Mapping = field(default_factory=dict)

    @cached_property
    def _index(self) -> dict[str, torch.Tensor]:
        """Stat name -> tensor of every field of the statistics and their parts (not the lazy Ddot)."""
        parts = [p for p in (self, self.full, self.kept, self.topk) if p is not None]
        return {k: v for p in parts for k, v in _tensors(p).items()}

    def __iter__(self):
        yield from self._index
        if self.topk is not None:
            yield from (k for k in self.topk.names() if k in TOPK_DDOTS)
        yield from self.extras

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._index.get(name)
        if t is not None:
            return t
        if self.topk is not None and name in TOPK_DDOTS:
            return self.topk.ddot(*TOPK_DDOTS[name])
        return self.extras[name]

    def computed(self) -> dict[str, torch.Tensor]:
        """The tensors already computed, by stat name (a top-K ``Ddot`` only once read)."""
        return {**self._index, **(self.topk.ddots if self.topk is not None else {}), **self.extras}

    @classmethod
    def from_logprobs(cls, logp: torch.Tensor, sampled_logprob: torch.Tensor, valid: torch.Tensor, *,
                      sum_p2: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                      topk: TopKStats | None = None) -> "TokenStats":
        """The statistics from log-probs alone, for a framework that hands the loss no logits
        (verl). ``sum_p2`` None: its lower bound ``pi_k^2``, which changes the magnitude of the
        binary ``Ddot``, never its sign (``1 - 2 pi_k + sum pi^2 >= (1 - pi_k)^2 > 0``), and
        only the sign enters a mask; ``entropy`` None: 0; ``topk`` a top-K part made elsewhere."""
        lp = logp.detach()
        sum_p2 = lp.exp().square() if sum_p2 is None else sum_p2
        entropy = torch.zeros_like(lp) if entropy is None else entropy
        return cls(logp=logp, sampled_logprob=sampled_logprob, entropy=entropy, sum_p2=sum_p2, valid=valid.bool(),
                   topk=topk, **_binary(lp, sampled_logprob, sum_p2))


def _binary(logp: torch.Tensor, sampled_logprob: torch.Tensor, sum_p2: torch.Tensor) -> dict[str, torch.Tensor]:
    """The sampled token's statistics from detached ``log pi_k``, ``log mu_k``, ``sum_i pi_i^2``."""
    log_ratio = dv.log_ratio(logp, sampled_logprob)
    return {"log_ratio": log_ratio, "ratio": capped_ratio(log_ratio),
            "binary_tv": dv.binary_tv(logp, sampled_logprob), "binary_kl": dv.binary_kl(logp, sampled_logprob),
            "ddot_binary_tv": dv.ddot_binary_tv(logp, sampled_logprob, sum_p2),
            "ddot_binary_kl": dv.ddot_binary_kl(logp, sampled_logprob, sum_p2)}


def _shaped(part, lead: tuple):
    shaped = {k: t.reshape(lead + tuple(t.shape[1:])) for k, t in _tensors(part).items()}
    if isinstance(part, TopKStats):
        return replace(part, values={k: shaped.pop(k) for k in part.values}, **shaped)
    return replace(part, **shaped)


def _assemble(red: ops.Reductions, batch, support: str) -> TokenStats:
    """:class:`TokenStats` (shaped like the rollout) from the (N,) reductions of a prepared batch."""
    logp_d, lse = red.logp.detach(), red.lse
    rlp = batch.sampled_logprob.to(lse.dtype)
    topk = full = kept = None
    if batch.topk_ids is not None:
        # pi's tail comes from its own reduction (lse_tail), not from 1 - sum pi: that rounds
        # to 0 in float32 once the tail holds less than ~6e-8 of the mass
        sup = dv.build_support(batch.sampled_ids, logp_d, rlp, batch.topk_ids, red.topk_logp,
                               batch.topk_logprobs.to(lse.dtype), red.sum_p2, batch.vocab_size,
                               log_pi_tail=red.lse_tail - lse, sum_p2_tail=red.sum_p2_tail, support=support)
        topk = TopKStats({name: d.value(sup) for name, d in TOPK_DIVERGENCES.items()}, sup.mu_tail, sup.pi_tail,
                         sup.mu_tail_clamped, sup.k_col < batch.topk_ids.shape[1], support=sup)
    if red.kept_mass is not None:
        # share of the top-K entries whose membership of the kept set differs between the
        # engine (a -inf processed log-prob: outside) and the trainer's rebuilt set
        mismatch = None if batch.topk_ids is None else \
            (torch.isfinite(batch.topk_logprobs) != torch.isfinite(red.topk_logp)).to(lse.dtype).mean(-1)
        kept = KeptStats(red.kept_mass, red.kept_size, red.sampled_outside, mismatch)
    if batch.rollout_logits is not None:
        full = FullStats(red.full_kl, red.full_tv, dv.ddot_full_kl(logp_d, red.full_mu_k, red.sum_p_mu, red.sum_p2),
                         dv.ddot_full_tv(logp_d, red.full_mu_k, red.sum_p_s, red.sum_p2_s, red.sum_p2))
    lead = batch.lead_shape
    st = TokenStats(logp=red.logp, sampled_logprob=rlp, entropy=red.entropy, sum_p2=red.sum_p2, valid=batch.valid,
                    **_binary(logp_d, rlp, red.sum_p2))
    return replace(_shaped(st, lead), topk=topk and _shaped(topk, lead), full=full and _shaped(full, lead),
                   kept=kept and _shaped(kept, lead))


def token_stats(logits, rollout: Rollout, *, sampling: ops.Sampling | None = None, compute: ops.Compute | None = None,
                support: str = "topk+sampled", validate: bool = True, checks=None) -> TokenStats:
    """Every per-token statistic (:class:`TokenStats`), shaped like ``rollout.sampled_ids``.

    ``logits``: (B, T, V) (reduced in float32; float64 kept), ``pi = softmax(logits /
    sampling.temperature)``, or :class:`pdmask.Hidden` states with the LM-head weight. The
    rollout's top-K adds the ``topk`` part, its ``logits`` (mu's) the ``full`` part, ``sampling``'s
    truncation (or ``rollout.kept_mask``) the ``kept`` part (pi renormalised over the kept set);
    ``support``: ``"topk+sampled"`` (``S' = topK ∪ {k}``) or ``"topk"`` (docs/core.md).
    ``validate``: check the rollout's values (one host sync before the logits are read, one
    after). ``checks(batch, pending)``: the caller's own checks, once the rollout is checked,
    adding its data checks to that first sync's ``pending`` (None without ``validate``)."""
    sampling = ops.Sampling() if sampling is None else sampling
    compute = ops.Compute() if compute is None else compute
    for name, v, cls in (("sampling", sampling, ops.Sampling), ("compute", compute, ops.Compute),
                         ("rollout", rollout, Rollout)):
        if not isinstance(v, cls):
            raise SpecError(name, f"must be a pdmask.{cls.__name__} (or None), got {type(v).__name__}")
    check_choice("support", support, SUPPORTS)
    hidden = isinstance(logits, ops.Hidden)
    x = logits.hidden if hidden else logits
    if not hidden and (not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2):
        raise SpecError("logits", "expected a floating-point (B, T, V) or (N, V) tensor, got "
                                  f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    if hidden and rollout.logits is not None:
        raise SpecError("rollout.logits", "the *-full-* modes are not available from hidden states")
    lead, V = tuple(x.shape[:-1]), (logits.weight.shape[0] if hidden else x.shape[-1])
    ops.check_truncation(compute.impl, sampling, rollout.kept_mask, rollout.logits, prefix="rollout.")
    pending = Checks() if validate else None
    batch = prepare(lead, V, x.device, rollout, validate, pending)
    if hidden and validate:  # else a bad weight shows only as non-finite rows of the hidden states
        pending.add("lm_head_weight", "contains NaN or inf", ~torch.isfinite(logits.weight).all())
    if checks is not None:
        checks(batch, pending)
    if validate:
        pending.run()  # the one sync before the logits are read: the rollout's checks and the caller's
    src = ops.Hidden(x.reshape(-1, x.shape[-1]), logits.weight) if hidden else x.reshape(-1, V)
    red = ops.row_stats(src, batch.sampled_ids, batch.topk_ids, sampling=sampling, compute=compute,
                        rollout_logits=batch.rollout_logits, kept_mask=batch.kept_mask, validate=False)
    if validate:  # one host sync, made only when validating (off on a trusted hot path)
        after = Checks()
        after.add("hidden" if hidden else "logits", "a response row has no finite logit (all -inf, or NaN/inf values)",
                  (~torch.isfinite(red.lse) & batch.valid).any())
        if batch.rollout_logits is not None:
            bad = ~(torch.isfinite(red.full_tv) & torch.isfinite(red.full_mu_k))
            after.add("rollout.logits", "a response row has no finite logit (all -inf, or NaN/inf values)",
                      (bad & batch.valid).any())
        after.run()
    return _assemble(red.padded(batch.valid, V), batch, support)
