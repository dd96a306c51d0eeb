"""pdmask trust-region masks as verl policy losses (``actor.policy_loss.loss_mode``).

verl 0.9.1 calls every registered policy loss as (``verl/workers/utils/losses.py:ppo_loss``)::

    pg_loss, pg_metrics = policy_loss_fn(
        old_log_prob=..., log_prob=..., advantages=..., response_mask=...,
        loss_agg_mode=config.loss_agg_mode, config=actor_config, rollout_is_weights=...)

with (B, T) padded response tensors: ``log_prob`` differentiable (log pi_theta of the
sampled tokens at the sampling temperature), ``old_log_prob`` the anchor (see below),
``response_mask`` bool, ``rollout_is_weights`` None unless
``algorithm.rollout_correction.rollout_is`` is set. Nothing else reaches the function: no
logits, no top-K. Hence two kinds of modes:

- **Binary modes** (``pdmask_dppo_binary_tv``, ``pdmask_dppo_binary_kl``, ``pdmask_drpo``,
  ``pdmask_spo``) work with stock verl: binary TV/KL of the sampled token, DRPO's and SPO's
  quadratic need only ``log pi_k`` and the anchor's ``log mu_k``. The anchor is ``old_log_prob`` exactly as verl passes it: the actor's
  recomputed pre-update log-prob (decoupled mode, verl's default) or the rollout engine's
  log-prob when ``algorithm.rollout_correction.bypass_mode=true`` copies
  ``rollout_log_probs`` into ``old_log_probs`` (the DPPO / pdmask anchor).
- **Top-K modes** (``pdmask_dppo_topk_{kl,tv}``, ``pdmask_pdm_topk_{kl,tv}[_<estimator>]``,
  ``pdmask_pdm_smooth_topk_{kl,tv}[_<estimator>]``) need per-token statistics reduced from the logits and the rollout top-K. The pdmask
  training engine (:mod:`.actor`) computes them in verl's logits-processor hook and
  hands them to these losses through :func:`rollout_stats`; their anchor is the rollout
  engine's own log-prob of the sampled token (``mu_k``), never a recomputed policy.

Thresholds use verl's DPPO convention (``verl/trainer/ppo/core_algos.py:
compute_policy_loss_dppo_tv``): ``actor.clip_ratio_low`` / ``clip_ratio_high`` are the
divergence thresholds delta for A < 0 / A > 0 (the smooth modes' scale delta: DRPO's
``drpo_epsilon``, SPO's epsilon), ``actor.clip_ratio_c`` is the IS cap C of the DPPO
surrogates (the smooth modes have none: their ratio is the weight).
The loss is the core's pipeline, not a copy of it: :class:`pdmask.TokenStats` from verl's
log-probs (:meth:`pdmask.TokenStats.from_logprobs`), with the actor hook's top-K part for the
top-K modes, then :func:`pdmask.loss_from_stats` (mask, corrections, surrogate, aggregation,
metrics), with verl's ``agg_loss`` arguments (``loss_agg_mode`` and
``config.global_batch_info``: ``dp_size``, the global ``batch_num_tokens`` /
``global_batch_size``, ``loss_scale_factor``) mapped onto one :class:`pdmask.Aggregation`
(:func:`aggregation`), so the loss is normalised over the global batch exactly like verl's
built-in losses under data parallelism and micro-batching. ``seq-mean-token-mean`` divides
each sequence by its token count ``n_b``, ``agg_loss`` by ``n_b + 1e-8``: on verl's bool
response mask that is a float32 equal to ``n_b``, so the two agree to the last bits (on a
float64 mask they would differ by at most 1e-8 relative; tests/integrations/verl).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import replace
from typing import Any, Callable

import torch

from ..._validate import SpecError, check_choice
from ...corrections import Corrections
from ...keys import ESTIMATORS, TOPK_DIVERGENCES
from ...loss import LOSS_AGG_READS, LOSS_AGGS, Aggregation, PolicyLoss
from ...masks import MODES, Thresholds, get_mode
from ...stats import TokenStats, TopKStats, topk_names
from ...surrogates import SURROGATES
from .binding import binding_metrics, region_check

PREFIX = "pdmask_"


# The lists below are read from the registries when called (pdmask.MODES, the top-K divergences), so
# a mode or divergence registered before verl builds its losses is one verl sees; BINARY_MODES,
# TOPK_MODES, SHIPPED and ANCHOR_DISTANCES are the same, as module attributes (computed on access).
def verl_modes() -> list[str]:
    """The modes verl can feed, in registry order: no caller-supplied tensors, no statistic beyond
    the rollout top-K, a trust region with a direction test and a delta (its thresholds are verl's
    ``clip_ratio_low`` / ``_high``). ``none``, ``cispo`` and ``grpo`` are verl's own losses."""
    return [n for n, m in MODES.items() if not m.extras and set(m.needs) <= {"topk"} and m.direction is not None
            and "eps" not in m.reads]


def binary_modes() -> tuple[str, ...]:
    """Modes whose statistics need only log pi_k and the anchor's log mu_k."""
    return tuple(n for n in verl_modes() if "topk" not in MODES[n].needs)


def topk_modes() -> tuple[str, ...]:
    """Modes that need the rollout top-K (the pdmask engine + rollout replica)."""
    return tuple(n for n in verl_modes() if "topk" in MODES[n].needs)


def shipped() -> tuple[str, ...]:
    """Per-token statistics the actor hook hands the top-K losses (all (B, T)): ``log mu_k``, the
    entropy and the top-K part of :class:`pdmask.TokenStats` (its stat names)."""
    return ("sampled_logprob", "entropy") + topk_names()


def anchor_distances() -> dict[str, str]:
    """Shipped besides, when the micro-batch carries pi_old (decoupled mode): ``D(mu, pi_old)`` of
    each top-K divergence (the hook does not know the loss mode), name -> divergence."""
    return {f"anchor_{d}": d for d in TOPK_DIVERGENCES}


_LISTS = {"BINARY_MODES": binary_modes, "TOPK_MODES": topk_modes, "SHIPPED": shipped,
          "ANCHOR_DISTANCES": anchor_distances}


def __getattr__(name: str):
    if name in _LISTS:
        return _LISTS[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

_ROLLOUT_STATS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("pdmask_verl_rollout_stats",
                                                                             default=None)
#: Set by the pdmask training engine around a training micro-batch that carries no rollout
#: top-K, so that a top-K loss can say which half of the setup is missing.
_ENGINE_WITHOUT_TOPK: contextvars.ContextVar[bool] = contextvars.ContextVar("pdmask_verl_engine_without_topk",
                                                                            default=False)


#: The update (mini-batch) index since the step's old-log-prob pass, set by the pdmask engine
#: around each ``train_batch`` (None: no such pass seen, e.g. bypass mode).
_UPDATE_INDEX: contextvars.ContextVar[int | None] = contextvars.ContextVar("pdmask_verl_update_index", default=None)


@contextlib.contextmanager
def update_index(u: int | None):
    """Make the update index ``u`` (1 = the first update after pi_old was scored) visible to
    the losses during one ``train_batch``."""
    token = _UPDATE_INDEX.set(u)
    try:
        yield
    finally:
        _UPDATE_INDEX.reset(token)


def loss_name(mode: str, estimator: str = "exact") -> str:
    """verl ``loss_mode`` of a pdmask mode: ``pdm-topk-kl`` -> ``pdmask_pdm_topk_kl``;
    a non-default estimator is appended (``pdmask_pdm_topk_kl_aggregated``)."""
    name = PREFIX + mode.replace("-", "_")
    return name if estimator == "exact" else f"{name}_{estimator}"


def registered_names() -> dict[str, tuple[str, str]]:
    """``{verl loss_mode: (pdmask mode, estimator)}`` of every loss this module registers.

    The estimator only changes the predictive direction, so the modes with the ratio
    direction (``dppo-*``, ``drpo``, ``spo``) are registered once; ``pdm-*`` once per estimator.
    """
    out = {}
    for mode in verl_modes():
        ests = ESTIMATORS if reads_estimator(mode) else ("exact",)
        for est in ests:
            out[loss_name(mode, est)] = (mode, est)
    return out


def reads_estimator(mode) -> bool:
    """Whether ``mode``'s direction test reads the top-K estimator: asked of the registered
    mode itself (the statistic its direction reads differs between two estimators), not of
    its name."""
    direction = get_mode(mode).direction
    if direction is None:
        return False
    read: list[set] = []

    class Probe(dict):  # records the statistics the direction reads
        def __getitem__(self, key):
            read[-1].add(key)
            return torch.zeros(1)

    for est in ESTIMATORS[:2]:
        read.append(set())
        direction(Probe(), est)
    return read[0] != read[1]


@contextlib.contextmanager
def rollout_stats(stats: dict[str, torch.Tensor]):
    """Make per-token top-K statistics (dict of (B, T) tensors, keys :data:`SHIPPED`)
    visible to the top-K losses during one verl ``ppo_loss`` call."""
    token = _ROLLOUT_STATS.set(stats)
    try:
        yield
    finally:
        _ROLLOUT_STATS.reset(token)


@contextlib.contextmanager
def engine_without_topk():
    """Mark one ``ppo_loss`` call as coming from the pdmask engine on a micro-batch without the
    rollout top-K (the error of a top-K loss then names the rollout, not the engine)."""
    token = _ENGINE_WITHOUT_TOPK.set(True)
    try:
        yield
    finally:
        _ENGINE_WITHOUT_TOPK.reset(token)


# ------------------------------------------------------------------ statistics
def binary_stats(log_prob: torch.Tensor, anchor_log_prob: torch.Tensor,
                 response_mask: torch.Tensor) -> TokenStats:
    """The statistics the binary modes read, from (B, T) log-probs alone:
    :meth:`pdmask.TokenStats.from_logprobs` (``sum_i pi_i^2``, which verl does not pass to a
    policy loss, at its sign-preserving lower bound ``pi_k^2``; ``entropy`` 0). The
    statistics read a copy with padding at a harmless placeholder (log-prob log 1/2, so
    nothing is NaN); ``logp`` is verl's own ``log_prob``, through which the gradient flows.
    """
    valid = response_mask.bool()
    filler = torch.full_like(log_prob, -0.6931471805599453)
    logp = torch.where(valid, log_prob.detach(), filler).clamp(max=0.0)
    anchor = torch.where(valid, anchor_log_prob.detach().to(log_prob.dtype), filler).clamp(max=0.0)
    return replace(TokenStats.from_logprobs(logp, anchor, valid), logp=log_prob)


def topk_stats(log_prob: torch.Tensor, response_mask: torch.Tensor,
               old_log_prob: torch.Tensor | None = None) -> tuple[TokenStats, torch.Tensor | None, dict]:
    """The statistics of the top-K modes: the actor hook's (B, T) top-K part plus the ratio
    ``log pi_k - log mu_k`` against the rollout engine's ``mu_k``; or, when the hook measured
    the top-K part against pi_old (decoupled mode: it shipped :data:`ANCHOR_DISTANCES`), the
    ratio ``log pi_k - old_log_prob`` (verl's pi_old). Returns ``(stats, log mu_k when anchored
    on pi_old else None, {divergence: D(mu, pi_old)})``."""
    st = _ROLLOUT_STATS.get()
    if st is None and _ENGINE_WITHOUT_TOPK.get():
        raise ValueError(
            "actor_rollout_ref.rollout.name: the micro-batch carries no pdmask top-K arrays (pdmask_topk_ids, ...) "
            "although the pdmask training engine runs; generate with actor_rollout_ref.rollout.name=pdmask_vllm "
            "(see docs/verl.md)")
    if st is None:
        raise ValueError(
            "config: a pdmask top-K loss_mode needs the per-token statistics of the pdmask training engine; "
            "set actor_rollout_ref.model.model_type=pdmask_language_model and "
            "actor_rollout_ref.rollout.name=pdmask_vllm (see docs/verl.md)")
    missing = [k for k in shipped() if k not in st and k != "entropy"]
    if missing:
        raise ValueError(f"rollout_stats: missing keys {missing}")
    shape = tuple(log_prob.shape)
    for k in st:
        if tuple(st[k].shape) != shape:
            raise ValueError(f"rollout_stats: {k!r} has shape {tuple(st[k].shape)}, log_prob has {shape}")
    valid = response_mask.bool()
    dt = log_prob.dtype
    filler = torch.full_like(log_prob, -0.6931471805599453)
    mu = torch.where(valid, st["sampled_logprob"].to(dt), filler)
    anchored = all(k in st for k in anchor_distances())
    rlp = mu if not anchored else torch.where(valid, old_log_prob.detach().to(dt), filler).clamp(max=0.0)
    logp = torch.where(valid, log_prob.detach(), rlp)
    topk = TopKStats.from_dict({k: st[k].bool() if k in ("tail_clamped", "sampled_in_topk") else st[k].to(dt)
                                for k in topk_names()})
    entropy = st.get("entropy", torch.zeros_like(logp)).to(dt)
    stats = replace(TokenStats.from_logprobs(logp, rlp, valid, entropy=entropy, topk=topk), logp=log_prob)
    dist = {div: st[name].to(dt) for name, div in anchor_distances().items()} if anchored else {}
    return stats, (mu if anchored else None), dist


# ------------------------------------------------------------------ the loss
#: verl's ``config.global_batch_info`` keys (filled by ``workers/utils/losses.py:ppo_loss`` for
#: ``agg_loss``) -> the :class:`pdmask.Aggregation` fields they become.
GLOBAL_BATCH_INFO = {"dp_size": "dp_size", "batch_num_tokens": "num_tokens", "global_batch_size": "num_seqs",
                     "loss_scale_factor": "loss_scale_factor"}


def aggregation(loss_agg_mode: str, global_batch_info: dict | None) -> Aggregation:
    """verl's ``agg_loss(loss_agg_mode=..., **global_batch_info)`` as one :class:`pdmask.Aggregation`.

    verl fills every key for every mode and ``agg_loss`` reads the ones its mode needs
    (``batch_num_tokens`` in token-mean, ``global_batch_size`` in the seq-mean modes,
    ``loss_scale_factor`` in ``seq-mean-token-sum-norm``, ``dp_size`` in all); exactly those
    are passed on (:data:`pdmask.loss.LOSS_AGG_READS`), so the loss is normalised over the
    global batch as verl's built-in losses are. A key verl 0.9.1 does not set is refused (a
    newer verl's normalisation must not be dropped unseen); with ``dp_size > 1`` the mode's
    global count is required, as in verl. Errors name the key:
    ``config.global_batch_info['batch_num_tokens']: required when dp_size > 1 ...``.
    Naive equivalent: ``Aggregation(loss_agg_mode, num_tokens=info["batch_num_tokens"], ...)``.
    """
    check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGGS)
    info = dict(global_batch_info or {})
    unknown = sorted(set(info) - set(GLOBAL_BATCH_INFO))
    if unknown:
        raise ValueError(f"config.global_batch_info: unknown key(s) {', '.join(map(repr, unknown))}; pdmask maps "
                         f"{', '.join(GLOBAL_BATCH_INFO)} (verl 0.9.1's) onto pdmask.Aggregation")
    reads = LOSS_AGG_READS[loss_agg_mode]
    kw = {f: info[k] for k, f in GLOBAL_BATCH_INFO.items()
          if info.get(k) is not None and (f == "dp_size" or f in reads)}
    try:
        return Aggregation(loss_agg_mode, **kw)
    except SpecError as e:  # the core names its field; name verl's key instead
        key = {f: k for k, f in GLOBAL_BATCH_INFO.items()}.get(e.field)
        if key is None:
            raise
        raise e.renamed(f"config.global_batch_info[{key!r}]") from None


def policy_loss_spec(mode_name: str, estimator: str, config, anchor: str = "rollout") -> PolicyLoss:
    """The one :class:`pdmask.PolicyLoss` of a verl loss and actor config: verl's DPPO fields
    as the thresholds (``clip_ratio_low`` / ``clip_ratio_high``, each falling back to
    ``clip_ratio``) and the IS cap (``clip_ratio_c``; not for the smooth modes on the rollout
    anchor, whose ratio pi/mu is the weight; with ``anchor="old"`` it caps the behaviour weight
    pi_old/mu in every mode). The aggregation is each call's (:func:`aggregation`:
    ``loss_agg_mode`` and ``config.global_batch_info``, passed to :meth:`pdmask.PolicyLoss.from_stats`)."""
    dl = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    dh = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    own = not SURROGATES[get_mode(mode_name).surrogate].takes_is_weight and anchor == "rollout"  # ratio = weight
    return PolicyLoss(mode=mode_name, estimator=estimator, thresholds=Thresholds(dl, dh), anchor=anchor,
                      corrections=Corrections() if own else Corrections(is_cap=float(config.clip_ratio_c)))


def _spec_once(specs: dict, mode_name: str, estimator: str, config, anchor: str = "rollout") -> PolicyLoss:
    """:func:`policy_loss_spec`, built once per loss, actor config and anchor (verl passes the
    same config to every call; ``specs`` is the loss's own cache, keyed by the fields read)."""
    key = (config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio, config.clip_ratio_c, anchor)
    if key not in specs:
        specs[key] = policy_loss_spec(mode_name, estimator, config, anchor)
    return specs[key]


def masked_policy_loss(
    mode_name: str,
    estimator: str,
    stats: TokenStats,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config,
    rollout_is_weights: torch.Tensor | None,
    *,
    has_entropy: bool,
    replace_weight: bool = False,
    spec: PolicyLoss | None = None,
    behaviour_logprob: torch.Tensor | None = None,
    distance: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """pdmask's loss on verl's (B, T) tensors: :func:`pdmask.loss_from_stats`, the
    core's pipeline (mask, corrections, surrogate, aggregation), with verl's
    ``agg_loss`` arguments as its :class:`pdmask.Aggregation`; nothing is aggregated here.

    Binary modes: ``loss = aggregate(-M * sg(min(r, C)) * A * log pi_k [* rollout_is_weights])``
    (r against ``old_log_prob``; verl's weights, against another policy than that anchor,
    multiply each token's loss: ``loss_weights``, verl's three-policy decoupled form).
    Top-K modes: ``loss = aggregate(-M * sg(w) * A * log pi_k)`` with ``w = min(pi_k/mu_k, C)``,
    or, when verl passes ``rollout_is_weights`` (``algorithm.rollout_correction.rollout_is``
    in decoupled mode), ``w = rollout_is_weights`` in its place (``is_weights``): verl's token /
    sequence TIS or MIS weight against the same mu (a weight of 0, verl's MIS, masks the
    token). ``M`` from :func:`pdmask.mask_from_stats` (see :func:`pdmask.policy_loss`).
    Top-K modes in decoupled mode (``behaviour_logprob``: mu's ``log mu_k``; ``stats`` against
    verl's ``old_log_prob``, pi_old): the anchored loss, ``w(pi_old/mu)`` on the surrogate of
    ``pi/pi_old`` with ``w = min(., C)`` or verl's ``rollout_is_weights`` (computed by verl from
    the same pi_old and mu), and the anchored metrics (``distance``: ``D(mu, pi_old)``).
    ``spec``: the loss's :func:`policy_loss_spec`, built once (None: built here).
    """
    anchor = "rollout" if behaviour_logprob is None else "old"
    spec = policy_loss_spec(mode_name, estimator, config, anchor) if spec is None else spec
    weights = {}
    if rollout_is_weights is not None:
        weights["is_weights" if replace_weight else "loss_weights"] = rollout_is_weights
    if behaviour_logprob is not None:
        weights["behaviour_logprob"] = behaviour_logprob
    out = spec.from_stats(stats, advantages, response_mask,
                          aggregation=aggregation(loss_agg_mode, config.global_batch_info), **weights)
    m = dict(out.metrics)
    m.update(binding_metrics(out, spec, advantages, response_mask, distance, _UPDATE_INDEX.get()))
    region_check(out, spec, response_mask, _UPDATE_INDEX.get())
    m.pop("loss")  # verl reports the loss itself (actor/pg_loss)
    if not has_entropy:
        m.pop("entropy_mean")
    metrics: dict[str, Any] = {f"pdmask/{k}": v for k, v in m.items()}
    # verl's dashboard names (what its dppo_* losses report), for side-by-side runs
    metrics["actor/pg_clipfrac"] = m["masked_frac"]
    valid = response_mask.bool()
    n = valid.sum().clamp(min=1)
    metrics["actor/ppo_kl"] = (torch.where(valid, -stats["log_ratio"], torch.zeros_like(log_prob)).sum() / n).detach()
    return out.loss, metrics


def check_finite_loss(name: str, call: int, loss: torch.Tensor, config, **inputs: torch.Tensor) -> None:
    """Stop at the first non-finite loss with one line naming the loss, its call and the
    inputs that hold the non-finite values: verl's own guard (``optimizer_step`` skips an
    update whose gradient norm is not finite and prints a warning) is not relied on, since a
    run that goes on after it trains on nothing. verl passes a policy loss no step number,
    so the line counts this loss's calls in this process (one per micro-batch). One host sync
    per call. Naive equivalent: ``assert torch.isfinite(loss)``."""
    if bool(torch.isfinite(loss.detach()).all()):
        return
    valid = inputs["response_mask"].bool()
    bad = [f"{k} ({int((~torch.isfinite(t.detach()) & valid).sum())} tokens)" for k, t in inputs.items()
           if k != "response_mask" and bool((~torch.isfinite(t.detach()) & valid).any())]
    lr = getattr(getattr(config, "optim", None), "lr", None)
    raise FloatingPointError(
        f"{name}: the loss is {float(loss.detach()):g} (non-finite) on its call {call} in this worker "
        f"(a micro-batch; verl passes a policy loss no step number); non-finite inputs: {', '.join(bad) or 'none'}: "
        "the weights went non-finite at an earlier update (log_prob) or the batch holds NaN; lower "
        f"actor_rollout_ref.actor.optim.lr{f' (now {lr:g})' if isinstance(lr, (int, float)) else ''}")


def make_policy_loss(mode_name: str, estimator: str = "exact") -> Callable:
    """A verl ``PolicyLossFn`` for one pdmask mode (signature as verl calls it)."""
    get_mode(mode_name)
    check_choice("mode", mode_name, verl_modes())  # the modes verl can feed
    topk = "topk" in MODES[mode_name].needs
    specs: dict = {}  # the PolicyLoss of each actor config, built once
    calls = [0]  # this loss's calls in this process: verl passes a policy loss no step number

    def policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config=None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        if config is None:
            raise ValueError("config: the actor config is required (thresholds, IS cap, global_batch_info)")
        if tuple(old_log_prob.shape) != tuple(log_prob.shape) or tuple(advantages.shape) != tuple(log_prob.shape):
            raise ValueError(f"old_log_prob/advantages: expected shape {tuple(log_prob.shape)}, got "
                             f"{tuple(old_log_prob.shape)} / {tuple(advantages.shape)}")
        behaviour, distance = None, None
        if topk:
            # verl's rollout_is_weights (decoupled mode) replace the weight min(pi/mu, C) (rollout
            # anchor) or min(pi_old/mu, C) (pi_old in the micro-batch): all are IS weights against
            # the same rollout mu, so a product would count the mismatch twice
            stats, behaviour, dists = topk_stats(log_prob, response_mask, old_log_prob)
            distance = dists.get(get_mode(mode_name).divergence)
            has_entropy = "entropy" in (_ROLLOUT_STATS.get() or {})
        else:
            stats = binary_stats(log_prob, old_log_prob, response_mask)
            has_entropy = False
        if rollout_is_weights is not None and tuple(rollout_is_weights.shape) != tuple(log_prob.shape):
            raise ValueError(f"rollout_is_weights: expected shape {tuple(log_prob.shape)}, got "
                             f"{tuple(rollout_is_weights.shape)}")
        calls[0] += 1
        anchor = "rollout" if behaviour is None else "old"
        loss, metrics = masked_policy_loss(mode_name, estimator, stats, log_prob, advantages, response_mask,
                                           loss_agg_mode, config, rollout_is_weights, has_entropy=has_entropy,
                                           replace_weight=topk, spec=_spec_once(specs, mode_name, estimator, config,
                                                                                anchor),
                                           behaviour_logprob=behaviour, distance=distance)
        check_finite_loss(loss_name(mode_name, estimator), calls[0], loss, config,
                          log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages,
                          response_mask=response_mask)
        return loss, metrics

    policy_loss.__name__ = policy_loss.__qualname__ = loss_name(mode_name, estimator)
    policy_loss.__doc__ = f"pdmask mode {mode_name!r} (estimator {estimator!r}) as a verl policy loss."
    return policy_loss


def register_losses() -> list[str]:
    """Register every pdmask loss in verl's ``POLICY_LOSS_REGISTRY``; returns the names."""
    from verl.trainer.ppo.core_algos import register_policy_loss

    names = []
    for name, (mode, est) in registered_names().items():
        register_policy_loss(name)(make_policy_loss(mode, est))
        names.append(name)
    return names
