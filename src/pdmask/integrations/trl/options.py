"""What the pdmask trainer does with every TRL 1.16 ``GRPOConfig`` option that changes the objective.

The pdmask trainer replaces TRL's policy loss with :func:`pdmask.policy_loss`, anchored on
the rollout policy mu the generator reports (or, with ``anchor="old"``, on TRL's old
log-probs, :func:`check_anchor`). Each TRL option that shapes TRL's loss is
therefore either **honoured** (it means the same here; :func:`loss_spec` maps it) or
**refused** at config time: :func:`check` raises a one-line ``ValueError`` that starts
with the option's name. This module is the one place that decides; :data:`OPTIONS` is the
table (``docs/trl.md`` lists it), :data:`NEUTRAL` the TRL fields that do not touch the
objective, and a test checks that every ``GRPOConfig`` field of TRL is in one of the two.

Off-policy corrections go through the core (:mod:`pdmask.corrections`): TRL's own
``vllm_importance_sampling_*`` and ``off_policy_mask_threshold`` where they map exactly,
pdmask's ``is_*`` / ``rejection*`` fields of the config otherwise (:func:`corrections`);
TRL's ``top_k`` / ``top_p`` / ``min_p`` become the loss's truncated-sampling arguments
(:func:`sampling`).

The mask modes the trainer runs are computed from the registry (:func:`accepted_modes`: a
mode whose inputs the trainer supplies), and pdmask's IS fields default to "not set"
sentinels (:data:`UNSET`), so a both-set refusal never compares a value with the default.

Imports TRL only to read its defaults (:func:`trl_default`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cache
from typing import Any, Callable

from ... import MODES, SURROGATES
from ..._validate import SpecError, check_choice
from ...corrections import DEFAULT_IS_CAP, Corrections

#: TRL ``loss_type`` values whose aggregation the trainer reproduces; ``cispo`` also sets the IS
#: weight, TRL's CISPO ``sg(min(r, epsilon_high))`` (:func:`cispo`).
LOSS_TYPES = ("dapo", "bnpo", "grpo", "dr_grpo", "cispo")


@cache
def _trl_defaults() -> dict[str, Any]:
    from trl import GRPOConfig

    out = {}
    for f in dataclasses.fields(GRPOConfig):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def trl_default(name: str) -> Any:
    """TRL's default value of a ``GRPOConfig`` field."""
    return _trl_defaults()[name]


def _changed(args, name: str) -> bool:
    return getattr(args, name) != trl_default(name)


def _grpo(args) -> bool:
    return args.mask_mode == "grpo"


def _ratio_weighted(args) -> bool:
    """The mode's surrogate differentiates its ratio pi/mu (it takes no separate IS weight: grpo, drpo,
    spo, pdm-smooth-*): the ratio is its IS weight. Not with ``anchor="old"``: the ratio is then
    pi/pi_old and the IS weight pi_old/mu is its own."""
    return (args.mask_mode in MODES and not SURROGATES[MODES[args.mask_mode].surrogate].takes_is_weight
            and getattr(args, "anchor", "rollout") != "old")


def cispo(args) -> bool:
    """``loss_type="cispo"``: TRL 1.16's CISPO (``grpo_trainer.py:3109-3111``), the IS weight
    ``sg(min(r, epsilon_high))`` on ``-A log pi_k`` and the ``dapo`` aggregation
    (``:3168-3173``); ``epsilon_high`` falls back to ``epsilon`` as in TRL. With ``mask_mode="none"``
    it is TRL's loss; another mode with an IS weight adds its mask."""
    return args.loss_type == "cispo"


def _reads_eps(args) -> bool:
    """``epsilon`` / ``epsilon_high`` mean something here: the mode reads the ratio clip (``grpo``;
    ``cispo``'s preset) or ``loss_type="cispo"`` caps the IS weight at ``epsilon_high``."""
    return cispo(args) or (args.mask_mode in MODES and "eps" in MODES[args.mask_mode].reads)


def _refuse_loss_type(a) -> str | None:
    if a.loss_type not in LOSS_TYPES:
        return f"{a.loss_type!r} is not supported with a trust-region mask; valid values are: {', '.join(LOSS_TYPES)}"
    if not cispo(a):
        return None
    mode = MODES[a.mask_mode]
    if not SURROGATES[mode.surrogate].takes_is_weight:
        return (f"'cispo' weights -A log pi_k by sg(min(r, epsilon_high)), a separate IS weight, but "
                f"mask_mode={a.mask_mode!r} differentiates its ratio ({mode.surrogate} surrogate); use mask_mode='none' "
                "(TRL's CISPO) or a dppo / pdm mode (CISPO's weight under its mask)")
    if mode.corrections is not None:
        return (f"'cispo' is TRL's CISPO, sg(min(r, epsilon_high)); mask_mode={a.mask_mode!r} sets its own IS weight "
                f"({mode.doc}); use mask_mode='none' with loss_type='cispo', or loss_type='dapo' with "
                f"mask_mode={a.mask_mode!r}")
    set_ = [n for n in UNSET if is_set(a, n)] + (["vllm_importance_sampling_correction"] if vllm_is_on(a) else [])
    if set_:
        return (f"'cispo' sets the IS weight to sg(min(r, epsilon_high)) against the generator's mu, and "
                f"{', '.join(set_)} would set another; leave {'them' if len(set_) > 1 else 'it'} unset / off")
    return None



# ------------------------------------------------------------------ mask modes
#: the inputs a mode may need (``MaskMode.needs``) that the trainer supplies: the top-K
#: capture; why it cannot supply the others
SUPPLIED_NEEDS = frozenset({"topk"})
UNSUPPLIED_NEEDS = {
    "full": "needs the generator's full logits, which neither vLLM nor generate() report; use a *-topk-* mode",
}


def mode_refusal(mode) -> str | None:
    """Why the trainer cannot run ``mode`` (a :class:`pdmask.MaskMode`), or None: a mode runs iff
    every input it needs is one the trainer supplies (:data:`SUPPLIED_NEEDS`) and it reads no
    caller-supplied per-token tensor (``MaskMode.extras``: the batch modes' direction)."""
    for need in sorted(set(mode.needs) - SUPPLIED_NEEDS):
        return UNSUPPLIED_NEEDS.get(need, f"needs {need!r} inputs, which the TRL trainer does not supply")
    if mode.extras:
        return (f"needs the per-token tensor(s) {', '.join(mode.extras)} from its caller (the batch modes' model-"
                "aware direction, pdmask_lab.batchmask), which the TRL trainer does not compute; use a *-topk-* mode")
    return None


def accepted_modes() -> list[str]:
    """The registered modes (:data:`pdmask.MODES`, in registry order) the trainer accepts: computed
    from the registry, so a mode registered later is listed when it can run."""
    return [name for name, mode in MODES.items() if mode_refusal(mode) is None]


def check_mode(args) -> None:
    """``mask_mode`` names a registered mode the trainer can run; the error lists :func:`accepted_modes`."""
    name = args.mask_mode
    mode = MODES.get(name) if isinstance(name, str) else None
    why = mode_refusal(mode) if mode is not None else None
    if why:
        raise SpecError("mask_mode", f"{name!r} {why}")
    check_choice("mask_mode", name, accepted_modes())


# ------------------------------------------------------------------ "not set" sentinels
#: pdmask's default IS cap, used when ``is_cap`` is not set.
IS_CAP_DEFAULT = DEFAULT_IS_CAP
#: pdmask's IS-weight fields of the config whose default means "not set" (the sentinel), and what
#: an unset field becomes: TRL's vLLM correction when that is on, else the core's default. A
#: both-set refusal tests the sentinel, never a comparison with the default (``is_cap=5.0``
#: written out is set). ``is_floor``: None is both "not set" and "no lower bound".
UNSET = {"is_level": "auto", "is_cap": None, "is_floor": None, "is_mask": None}
IS_DEFAULTS = {name: getattr(Corrections, name) for name in UNSET}


def is_set(args, name: str) -> bool:
    """The user gave ``name`` (one of :data:`UNSET`) a value."""
    return getattr(args, name) != UNSET[name]


def _refuse_delta(a) -> str | None:
    if a.delta is None:
        return None
    if not _grpo(a):
        return "two-sided clipping applies to mask_mode='grpo' only; the dppo/pdm modes cap the IS weight with is_cap"
    if is_set(a, "is_cap") and not a.is_mask and a.is_cap != a.delta:
        return f"and is_cap={a.is_cap} both set the grpo dual clip; set one of them"
    eps_high = a.epsilon_high if a.epsilon_high is not None else a.epsilon
    if not a.delta > 1 + eps_high:
        return f"must be greater than 1 + epsilon_high = {1 + eps_high}, got {a.delta}"
    return None


@dataclass(frozen=True)
class Option:
    """One TRL option: ``name``, ``treatment`` (``honoured`` / ``refused`` / ``refused unless ...``),
    ``how`` (one line for the docs) and ``refuse(args) -> reason | None``."""

    name: str
    treatment: str
    how: str
    refuse: Callable[[Any], str | None] | None = None


def _when(cond: Callable[[Any], bool], reason: str) -> Callable[[Any], str | None]:
    return lambda a: reason if cond(a) else None


#: TRL's vllm_importance_sampling_mode -> (is_level, is_mask).
VLLM_IS_MODES = {"token_truncate": ("token", False), "token_mask": ("token", True),
                 "sequence_truncate": ("sequence", False), "sequence_mask": ("sequence", True)}


def vllm_is_on(a) -> bool:
    """TRL applies its vLLM IS correction (and so does the pdmask trainer, in its place)."""
    return bool(a.use_vllm and a.vllm_importance_sampling_correction)


def _refuse_vllm_is(a) -> str | None:
    if not vllm_is_on(a):
        return None
    if _ratio_weighted(a):
        return (f"mask_mode={a.mask_mode!r} already weights by its ratio pi/mu against the vLLM sampler mu (a second "
                "weight would count it twice); set vllm_importance_sampling_correction=False")
    if a.vllm_importance_sampling_mode not in VLLM_IS_MODES:
        return None  # TRL's own config refuses an unknown mode first
    set_ = [n for n in UNSET if is_set(a, n)]
    if set_:
        return (f"and {', '.join(set_)} both set the IS weight; set vllm_importance_sampling_correction=False to "
                f"use pdmask's {', '.join(set_)}, or leave {'them' if len(set_) > 1 else 'it'} unset")
    return None


def _refuse_unless_vllm_is(name: str) -> Callable[[Any], str | None]:
    def refuse(a):
        if vllm_is_on(a) or not _changed(a, name):
            return None
        return ("has no effect unless use_vllm=True and vllm_importance_sampling_correction=True (as in TRL); "
                "leave it at TRL's default, or set pdmask's is_level / is_mask / is_floor / is_cap")
    return refuse


def _refuse_sequence_ratio(a) -> str | None:
    level = a.importance_sampling_level
    if level == "token":
        return None
    if level != "sequence":
        return f"unknown value {level!r}; valid values are: token, sequence"
    if _grpo(a):
        return ("'sequence' (GSPO) clips one length-normalised ratio per sequence, exp(mean_t log(pi_t / mu_t)); "
                "mask_mode='grpo' clips each token's ratio pi_t / mu_t and the core has no sequence-ratio "
                "surrogate; set importance_sampling_level='token'")
    return (f"'sequence' (GSPO) replaces each token's ratio by one per sequence, but mask_mode={a.mask_mode!r} "
            "masks and weights each token by its own divergence and ratio; for a sequence-level IS weight set "
            "is_level='sequence' (the product over the sequence, capped at is_cap) and "
            "importance_sampling_level='token'")


def _refuse_beta(a) -> str | None:
    b = a.beta
    if isinstance(b, bool) or not isinstance(b, (int, float)):
        return f"must be a number >= 0, got {b!r}"
    if not math.isfinite(b):
        return (f"must be finite, got {b!r}: the first update would turn every weight NaN (and TRL's logged "
                "loss would read 0); use beta=0.0 for no KL term")
    if b < 0:
        return (f"must be >= 0, got {b!r}: a negative KL weight rewards moving away from the reference model; "
                "use beta=0.0 for no KL term")
    if b == 0.0 or not sampling(a).truncated:
        return None
    return ("the KL term to the reference model is TRL's, on the full softmax(logits / T), but with top_k / top_p / "
            "min_p the loss's log pi is renormalised over the kept set; set beta=0.0 or sample without truncation")


OPTIONS: tuple[Option, ...] = (
    Option("loss_type", "honoured for dapo, bnpo, grpo, dr_grpo, cispo",
           "aggregation of the per-token loss as TRL normalises it (token sum over the generation batch, "
           "local token mean, per-sequence mean, sum / (B x max_completion_length)); cispo: dapo's, and the IS "
           "weight TRL's CISPO sg(min(r, epsilon_high)) (mask_mode='none': TRL's loss; refused with a mode "
           "whose ratio is its weight, with mask_mode='cispo', and with another IS setting)", _refuse_loss_type),
    Option("epsilon", "honoured in mask_mode='grpo' and 'cispo' and with loss_type='cispo', refused otherwise",
           "grpo: the clip range [1 - epsilon, 1 + epsilon_high] of r = pi/mu; mask_mode='cispo': the IS weight's "
           "clip, the same range; loss_type='cispo': the fallback of epsilon_high",
           _when(lambda a: not _reads_eps(a) and _changed(a, "epsilon"),
                 "not used by this mask_mode (its thresholds are mask_delta_low / mask_delta_high); "
                 "leave it at TRL's default or use mask_mode='grpo'")),
    Option("epsilon_high", "honoured in mask_mode='grpo' and 'cispo' and with loss_type='cispo', refused otherwise",
           "grpo: the upper clip (clip-higher); loss_type='cispo': the IS cap, TRL's epsilon_max",
           _when(lambda a: not _reads_eps(a) and a.epsilon_high is not None,
                 "not used by this mask_mode (its thresholds are mask_delta_low / mask_delta_high); "
                 "leave it unset or use mask_mode='grpo'")),
    Option("delta", "honoured in mask_mode='grpo', refused otherwise",
           "grpo: TRL's two-sided clip caps the ratio of A < 0 tokens at delta -- the same objective as "
           "pdmask's dual clip, so dual_clip = delta", _refuse_delta),
    Option("importance_sampling_level", "honoured for 'token', refused for 'sequence' (GSPO)",
           "the mask, the ratio and the IS weight are per token. 'sequence' is refused in every mode: grpo "
           "clips each token's ratio pi/mu and the core has no sequence-ratio surrogate; the dppo / pdm / none "
           "modes decide per token (a sequence IS weight there is is_level='sequence')", _refuse_sequence_ratio),
    Option("beta", "honoured (refused with top_k / top_p / min_p truncation, and unless finite and >= 0)",
           "TRL's k3 KL term to the reference model, added as TRL adds it: beta x (exp(ref - logp) - (ref - logp) "
           "- 1) on every response token, masked ones included, aggregated by loss_type; logged as `kl`. The "
           "reference log-probs are TRL's forward of its ref_model, with position ids as the loss counts them",
           _refuse_beta),
    Option("use_bias_correction_kl", "honoured (with beta != 0)",
           "the k3 term times the ratio pi/mu (TRL: pi/pi_old, the same on the first pass over a batch), "
           "gradient included, as TRL multiplies it"),
    Option("entropy_coef", "refused unless 0", "no entropy bonus",
           _when(lambda a: a.entropy_coef != 0.0, "the entropy bonus is not supported; set entropy_coef=0.0")),
    Option("use_adaptive_entropy", "refused unless False", "no entropy bonus",
           _when(lambda a: a.use_adaptive_entropy,
                 "the entropy bonus is not supported; set use_adaptive_entropy=False")),
    Option("off_policy_mask_threshold", "honoured",
           "DeepSeek-V3.2's off-policy sequence mask after the trust-region mask "
           "(pdmask.Corrections(off_policy_mask_threshold=delta)), every mode"),
    Option("top_entropy_quantile", "refused unless 1.0", "every token is trained",
           _when(lambda a: a.top_entropy_quantile < 1.0, "must be 1.0 with a trust-region mask")),
    Option("vllm_importance_sampling_correction",
           "honoured with use_vllm=True in the dppo/pdm modes, refused with grpo, drpo, spo and pdm-smooth-* (their "
           "ratio is the weight; a no-op without vLLM, as in TRL)",
           "TRL's mode and bounds choose the IS weight against the vLLM sampler mu in place of min(pi/mu, is_cap) "
           "(is_level / is_mask / is_floor / is_cap, see vllm_importance_sampling_mode)", _refuse_vllm_is),
    Option("vllm_importance_sampling_mode", "honoured with the correction on (see above), refused otherwise "
           "unless TRL's default",
           "token_truncate: is_level='token'; sequence_truncate: is_level='sequence'; token_mask / sequence_mask: "
           "the same with is_mask=True (MIS; IcePop at token level)", _refuse_unless_vllm_is("vllm_importance_sampling_mode")),
    # _cap: TRL copies the deprecated _cap into _clip_max; both are checked as _clip_max
    *(Option(name, "honoured with the correction on (see above), refused otherwise unless TRL's default", how,
             _refuse_unless_vllm_is(name))
      for name, how in (("vllm_importance_sampling_cap", "deprecated TRL alias of vllm_importance_sampling_clip_max"),
                        ("vllm_importance_sampling_clip_max", "is_cap (None: no upper bound)"),
                        ("vllm_importance_sampling_clip_min", "is_floor (None or 0: no lower bound)"))),
    Option("vllm_structured_outputs_regex", "refused unless None",
           "guided decoding changes the sampler's distribution; not verified with the captured log-probs",
           _when(lambda a: a.vllm_structured_outputs_regex is not None,
                 "structured outputs are not supported by the pdmask trainer (not verified that vLLM's reported "
                 "log-probs include the grammar mask)")),
    Option("use_liger_kernel", "refused unless False", "Liger's fused loss is not used",
           _when(lambda a: bool(getattr(a, "use_liger_kernel", False)), "Liger's fused loss is not used")),
    # _paged first: TRL turns the deprecated use_transformers_paged into continuous batching
    Option("use_transformers_paged", "refused unless False", "as use_transformers_continuous_batching",
           _when(lambda a: bool(a.use_transformers_paged),
                 "paged generation reports no per-step scores; use generate() or vLLM")),
    Option("use_transformers_continuous_batching", "refused unless False",
           "continuous batching reports no per-step scores",
           _when(lambda a: bool(a.use_transformers_continuous_batching),
                 "continuous batching reports no per-step scores; use generate() or vLLM")),
    Option("router_aux_loss_coef", "honoured", "MoE load-balancing loss added as TRL adds it (coef x aux / GA)"),
    Option("num_iterations", "honoured", "updates per generation batch; the region stays centred on mu (the mask "
           "acts), or on TRL's pi_old with anchor='old'"),
    Option("steps_per_generation", "honoured", "dapo normaliser, as in TRL"),
    Option("generation_batch_size", "honoured", "dapo normaliser, as in TRL"),
    Option("max_completion_length", "honoured", "dr_grpo normaliser, as in TRL"),
    Option("temperature", "honoured", "pi = softmax(logits / T), the generator's T"),
    Option("top_p", "honoured",
           "truncated sampling: mu is renormalised over the kept set, so pi is too, over the set rebuilt from the "
           "same parameters (pdmask.Sampling(top_p=...))"),
    Option("top_k", "honoured", "as top_p (sampling_top_k)"),
    Option("min_p", "honoured (warns with top_k / top_p on the generate() path)",
           "as top_p (sampling_min_p); the kept set is rebuilt in vLLM's order (min-p first), generate() applies "
           "min-p last"),
    Option("repetition_penalty", "honoured (warns)", "mu includes the penalty, pi does not"),
    Option("generation_kwargs", "honoured", "part of the generation config the capture reads"),
    Option("mask_truncated_completions", "honoured", "TRL zeroes their completion mask"),
    Option("scale_rewards", "honoured", "TRL's advantages are used as they are"),
    Option("reward_weights", "honoured", "as scale_rewards"),
    Option("multi_objective_aggregation", "honoured", "as scale_rewards"),
    Option("num_generations", "honoured", "as scale_rewards (group size)"),
    Option("cast_lm_head_to_fp32", "honoured", "TRL casts the model's lm_head; the loss forward uses it"),
    Option("disable_dropout", "honoured", "TRL changes the model; the loss forward uses it"),
    Option("use_vllm", "honoured", "top-K from vLLM logprobs=K (colocate or server)"),
    Option("vllm_mode", "honoured", "as use_vllm"),
)

#: TRL fields that do not change the objective (or only together with a refused option).
NEUTRAL: dict[str, str] = {
    **dict.fromkeys(("model_init_kwargs", "trust_remote_code", "ds3_gather_for_generation", "shuffle_dataset",
                     "pad_to_multiple_of", "chat_template_kwargs", "cache_implementation", "num_generations_eval"),
                    "model loading, data order, padding, evaluation"),
    **dict.fromkeys(("vllm_model_impl", "vllm_enable_sleep_mode", "vllm_server_base_url", "vllm_server_host",
                     "vllm_server_port", "vllm_server_timeout", "vllm_group_port", "vllm_gpu_memory_utilization",
                     "vllm_max_model_length", "vllm_tensor_parallel_size"), "where and how vLLM runs"),
    **dict.fromkeys(("sapo_temperature_neg", "sapo_temperature_pos"), "used by loss_type='sapo' only (refused)"),
    **dict.fromkeys(("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
                    "used by loss_type='vespo' only (refused)"),
    **dict.fromkeys(("sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps"),
                    "how TRL updates its reference model (beta != 0): TRL's own callback, unchanged"),
    **dict.fromkeys(("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target"),
                    "used with use_adaptive_entropy only (refused)"),
    **dict.fromkeys(("log_completions", "log_multimodal", "num_completions_to_print", "log_unique_prompts",
                     "log_completions_hub_repo"), "logging"),
    "max_tool_calling_iterations": "tools are refused by the trainer",
    "transformers_continuous_batching_config": "continuous batching is refused",
}


def check(args) -> None:
    """Refuse, with a one-line ``ValueError`` naming the option, every TRL option the trainer cannot honour
    (``mask_mode`` first: the other decisions read it)."""
    check_mode(args)
    for opt in OPTIONS:
        why = opt.refuse(args) if opt.refuse is not None else None
        if why:
            raise ValueError(f"{opt.name}: {why}")


def old_logps_computed(args) -> bool:
    """TRL 1.16 scores a generation batch for ``old_per_token_logps`` (``_generate_and_score_completions``)
    iff ``gradient_accumulation_steps % (steps_per_generation x num_iterations) != 0``: a batch outlives an
    optimizer step (``num_iterations > 1``, ``steps_per_generation > gradient_accumulation_steps``). Its
    vLLM-IS-only forward does not count: pdmask's correction replaces TRL's, and pi_old would be pi."""
    return args.gradient_accumulation_steps % (args.steps_per_generation * args.num_iterations) != 0


def check_anchor(args) -> None:
    """``anchor``: one of :data:`pdmask.anchor.ANCHORS`; ``"old"`` only where TRL computes pi_old
    (:func:`old_logps_computed`), refused with one line saying why elsewhere."""
    from ...anchor import ANCHORS

    check_choice("anchor", args.anchor, ANCHORS)  # a SpecError: a one-line ValueError naming anchor
    if args.anchor == "old" and not old_logps_computed(args):
        G, S, N = args.gradient_accumulation_steps, args.steps_per_generation, args.num_iterations
        raise ValueError(
            f"anchor: 'old' centres the region on the old log-probs TRL computes when a generation batch outlives "
            f"an optimizer step, and here it does not: gradient_accumulation_steps={G} is a multiple of "
            f"steps_per_generation x num_iterations = {S} x {N}, so every update on a batch falls in one "
            "optimizer step and pi_old is pi itself (a region that never binds); set num_iterations > 1 or "
            "steps_per_generation > gradient_accumulation_steps, or anchor='rollout'")


def check_mask_options(args) -> None:
    """pdmask's own options that a mode would not use."""
    mode = MODES[args.mask_mode]
    if "delta" not in mode.reads:
        for name in ("mask_delta_low", "mask_delta_high"):
            if getattr(args, name) is not None:
                raise ValueError(f"{name}: not used by mask_mode={args.mask_mode!r} (its region is the ratio clip "
                                 "epsilon / epsilon_high); leave it None")


def _is_fields(args) -> dict[str, Any]:
    """The IS weight: TRL's vLLM correction when it is on (:data:`VLLM_IS_MODES`), else pdmask's
    ``is_*`` fields, an unset one (:data:`UNSET`) at the core's default (``delta`` is the dual
    clip in grpo mode, :func:`loss_spec`: there an ``is_cap`` equal to it without ``is_mask`` says
    the same and is dropped). TRL's bounds: ``clip_max`` None = no upper bound (``is_cap=inf``),
    ``clip_min`` None or 0 = no lower bound. ``loss_type="cispo"``: TRL's cap ``epsilon_high``."""
    if cispo(args):
        cap = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        return {"is_level": "token", "is_mask": False, "is_cap": cap, "is_floor": None}
    if vllm_is_on(args) and not _ratio_weighted(args):
        level, masked = VLLM_IS_MODES[args.vllm_importance_sampling_mode]
        hi, lo = args.vllm_importance_sampling_clip_max, args.vllm_importance_sampling_clip_min
        return {"is_level": level, "is_mask": masked, "is_cap": math.inf if hi is None else hi,
                "is_floor": lo if lo else None}
    out = {name: getattr(args, name) if is_set(args, name) else IS_DEFAULTS[name] for name in UNSET}
    if _grpo(args) and args.delta is not None and not out["is_mask"]:
        out["is_cap"] = None
    return out


def corrections(args):
    """The config's :class:`pdmask.Corrections`: pdmask's correction fields, the IS weight
    replaced by TRL's vLLM correction when that is on (an error then names TRL's fields)."""
    try:
        return Corrections.from_fields(args, **_is_fields(args), rejection=args.rejection or None,
                                       rejection_threshold=args.rejection_threshold or None)
    except ValueError as e:
        if vllm_is_on(args) and not _ratio_weighted(args):
            raise ValueError(f"vllm_importance_sampling_clip_min / _clip_max: {e}") from None
        raise


def _off(v, *off) -> Any:
    return None if v is None or v in off else v


def sampling(args):
    """The generator's :class:`pdmask.Sampling`: ``temperature`` and the truncation (``top_k`` /
    ``top_p`` / ``min_p``; ``generation_kwargs`` wins, as it does in TRL). An error names
    TRL's field."""
    from ...ops import Sampling

    gk = args.generation_kwargs or {}
    return Sampling(temperature=args.temperature, top_k=_off(gk.get("top_k", args.top_k), 0, -1),
                    top_p=_off(gk.get("top_p", args.top_p), 1.0), min_p=_off(gk.get("min_p", args.min_p), 0.0))


#: The core's argument names -> the config's field names (for its error messages).
_FIELD_OF = {"mode": "mask_mode", "estimator": "mask_estimator", "delta_low": "mask_delta_low",
             "delta_high": "mask_delta_high", "eps_low": "epsilon", "eps_high": "epsilon_high",
             "chunk_rows": "mask_chunk_size"}


def loss_spec(args):
    """The trainer's :class:`pdmask.PolicyLoss`, the one spec built from the config: the
    mask settings, the grpo clip range (``epsilon`` / ``epsilon_high``) and dual clip
    (``delta``), the corrections, the generator's sampling. Every setting is checked there, once; an error names the
    config's field."""
    from ...loss import PolicyLoss
    from ...masks import Thresholds
    from ...ops import Compute

    eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    try:
        dual = None
        if _grpo(args):
            # TRL's delta is the dual clip; with neither delta nor an is_cap that would be it (no
            # is_mask), none, as plain TRL, whose delta defaults to None (no two-sided clip)
            dual = args.delta if args.delta is not None else (
                None if is_set(args, "is_cap") and not args.is_mask else math.inf)
        return PolicyLoss(mode=args.mask_mode, estimator=args.mask_estimator,
                          thresholds=Thresholds(args.mask_delta_low, args.mask_delta_high, args.epsilon, eps_high, dual),
                          corrections=corrections(args), sampling=sampling(args),
                          compute=Compute(chunk_rows=args.mask_chunk_size), validate=args.mask_validate,
                          anchor=args.anchor)
    except SpecError as e:  # the core names its field; name the config's
        if e.field in _FIELD_OF:
            raise e.renamed(_FIELD_OF[e.field]) from None
        raise


__all__ = ["IS_CAP_DEFAULT", "IS_DEFAULTS", "LOSS_TYPES", "NEUTRAL", "OPTIONS", "Option", "SUPPLIED_NEEDS", "UNSET",
           "VLLM_IS_MODES", "accepted_modes", "check", "cispo", "check_anchor", "check_mask_options", "check_mode",
           "corrections", "is_set", "loss_spec", "mode_refusal", "old_logps_computed", "sampling", "trl_default",
           "vllm_is_on"]
