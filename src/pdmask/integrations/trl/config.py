"""``GRPOConfig`` with the trust-region mask's settings."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from trl import GRPOConfig as _TRLGRPOConfig

from ...divergences import default_delta
from . import options
from .options import IS_CAP_DEFAULT, LOSS_TYPES  # noqa: F401  (LOSS_TYPES: re-export)

#: K captured when ``rollout_top_k`` is left unset and the mode needs the top-K (the paper's K).
DEFAULT_TOP_K = 20


@dataclass
class PDMaskGRPOConfig(_TRLGRPOConfig):
    """TRL's ``GRPOConfig`` plus the mask settings (all prefixed by what they configure).

    The policy loss is :func:`pdmask.policy_loss` (METHOD.md section 2), anchored to the
    rollout policy mu reported by the generator (``anchor="rollout"``, the default; with
    ``anchor="old"`` to TRL's recomputed pi_old, mu then entering as the IS weight pi_old/mu)::

        loss_t = - M_t * sg(min(pi_k / mu_k, is_cap)) * A_t * log pi_k          (dppo-*, pdm-*)
        loss_t = max(-A r, -A clip(r, 1 - epsilon, 1 + epsilon_high)), r = pi_k / mu_k   (grpo)
        drpo, spo, pdm-smooth-*: no mask, a weight on the gradient (docs/core.md)

    TRL fields that keep their meaning: ``temperature`` (pi = softmax(logits / T), the
    same T the generator samples at), ``top_k`` / ``top_p`` / ``min_p`` (the captured mu
    is the truncated, renormalised distribution; pi is renormalised over the same kept
    set), ``vllm_importance_sampling_*`` and ``off_policy_mask_threshold`` (through
    :mod:`pdmask.corrections`; pdmask's ``is_*`` / ``rejection*`` fields otherwise), ``epsilon`` / ``epsilon_high`` / ``delta``
    (the ``grpo`` mode's clip and dual clip), ``loss_type`` (aggregation: ``dapo`` = token
    mean over the global accumulated batch, ``bnpo`` = local token mean, ``grpo`` =
    per-sequence mean, ``dr_grpo`` = sum / (B * max_completion_length); ``cispo`` = ``dapo``'s,
    with TRL's CISPO weight ``sg(min(pi_k / mu_k, epsilon_high))``: ``mask_mode="none"`` is TRL's loss).

    Every TRL option that changes the objective is honoured or refused (``ValueError``
    naming it) by :mod:`.options`, the one place that decides (``docs/trl.md`` has the table).
    """

    mask_mode: str = field(
        default="pdm-topk-kl",
        metadata={"help": "Trust-region mask mode: a mode of pdmask.MODES whose inputs the trainer captures "
                          "(pdmask.integrations.trl.options.accepted_modes(); the *-full-* modes need the "
                          "generator's full logits and the batch modes the model-aware direction: refused)."})
    mask_estimator: str = field(
        default="exact",
        metadata={"help": "Top-K tail estimator of the predictive direction: exact, aggregated (the paper), "
                          "uniform, truncated."})
    mask_delta_low: float | None = field(
        default=None,
        metadata={"help": "Divergence threshold for tokens with negative advantage, the scale delta of drpo, "
                          "spo and pdm-smooth-* (default: the mode's MaskMode.default_delta, "
                          f"{default_delta('topk_kl'):g} for KL, {default_delta('topk_tv'):g} for TV, "
                          f"{default_delta('topk_js'):g} for JS)."})
    mask_delta_high: float | None = field(
        default=None,
        metadata={"help": "Divergence threshold for tokens with positive advantage (default: the mode's)."})
    rollout_top_k: int | None = field(
        default=None,
        metadata={"help": "K: top log-probs captured per generated token (vLLM logprobs=K; a vLLM server must "
                          "allow it with --max-logprobs >= K). Default: 20 for the *-topk-* modes, 0 (only the "
                          "sampled token's log-prob) for grpo, none, dppo-binary-*. Must not exceed the "
                          "vocabulary size (checked when the trainer is built)."})
    is_cap: float | None = field(
        default=None,
        metadata={"help": "IS-weight cap C in min(pi/mu, C) (dppo/pdm modes) and upper bound of is_mask; "
                          f"the dual-clip constant in grpo mode unless delta is set. inf disables it. None (not "
                          f"set): {IS_CAP_DEFAULT}, TRL's vllm_importance_sampling_clip_max with its correction on."})
    is_level: str | None = field(
        default="auto",
        metadata={"help": "IS weight of the dppo/pdm modes (pdmask.corrections): 'token' (min(pi/mu, is_cap)), "
                          "'sequence' (the product over the sequence), None (no weight). 'auto' (not set): 'token', "
                          "or TRL's vllm_importance_sampling_mode with use_vllm and "
                          "vllm_importance_sampling_correction=True."})
    is_floor: float | None = field(
        default=None,
        metadata={"help": "Lower bound of the IS weight (truncate, or mask with is_mask). None: no lower bound."})
    is_mask: bool | None = field(
        default=None,
        metadata={"help": "Mask tokens (is_level='token': IcePop) or sequences whose weight lies outside "
                          "[is_floor, is_cap] instead of truncating the weight (MIS). None (not set): False, or "
                          "TRL's *_mask modes with its vLLM correction on."})
    is_batch_normalize: bool = field(
        default=False,
        metadata={"help": "Divide the IS weights by their mean over the micro-batch's response tokens (token level) "
                          "or sequences (verl's rollout_is_batch_normalize)."})
    rejection: str | None = field(
        default=None,
        metadata={"help": "Rejection rules, comma-separated (verl's rollout_rs names): token_k1..3, seq_sum_k1..3, "
                          "seq_mean_k1..3 (seq_mean_k1 = Geo-RS), seq_max_k2/k3."})
    rejection_threshold: str | None = field(
        default=None,
        metadata={"help": "One threshold per rule or one shared (verl's rollout_rs_threshold): a number, or "
                          "'lo_hi' for the k1 rules."})
    mask_chunk_size: int | None = field(
        default=None,
        metadata={"help": "Rows per chunk of the vocabulary reductions (default: 16M elements per chunk)."})
    loss_from_hidden: bool = field(
        default=False,
        metadata={"help": "Compute the loss from the decoder's final hidden states and lm_head.weight "
                          "(pdmask.policy_loss_from_hidden, chunked over the vocabulary) instead of the (B, T, V) "
                          "logits. The loss runs inside the model's (wrapped) forward. Refused at trainer init for "
                          "heads that are more than hidden @ W.T (lm_head bias, PEFT adapter or other replaced head, "
                          "final_logit_softcapping, logit_scale and other logit scaling) and with MoE router "
                          "aux loss; with cast_lm_head_to_fp32 the head runs in float32 as TRL's."})
    mask_validate: bool = field(
        default=True,
        metadata={"help": "Check the loss inputs (one host sync per micro-batch)."})
    anchor: str = field(
        default="rollout",
        metadata={"help": "Where the trust region is centred: 'rollout' (the generator's mu, DPPO's anchor) or "
                          "'old' (pi_old, the weights that generated the batch, from the old log-prob forward TRL "
                          "runs when num_iterations > 1 or steps_per_generation > gradient_accumulation_steps; the "
                          "top-K modes read pi_old at the generator's top-K ids from that same forward). With 'old' "
                          "the IS correction (is_* fields, TRL's vLLM correction) weighs pi_old/mu, detached. "
                          "Refused where TRL computes no old log-probs (docs/trl.md, 'The anchor')."})

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.is_level, str) and self.is_level.lower() in ("none", "null", ""):
            self.is_level = None  # from the command line
        options.check(self)  # mask_mode and the TRL options first (a refused one explains the rest)
        options.check_anchor(self)
        spec = options.loss_spec(self)  # every mask, correction and sampling setting, checked once
        mode = spec.mask_mode
        if self.rollout_top_k is None:
            self.rollout_top_k = DEFAULT_TOP_K if "topk" in mode.needs else 0
        if isinstance(self.rollout_top_k, bool) or not isinstance(self.rollout_top_k, int) or self.rollout_top_k < 0:
            raise ValueError(f"rollout_top_k: must be a non-negative int, got {self.rollout_top_k!r}")
        if "topk" in mode.needs and self.rollout_top_k < 1:
            raise ValueError(f"rollout_top_k: mode {self.mask_mode!r} needs K >= 1, got {self.rollout_top_k!r}")
        options.check_mask_options(self)
        gk = self.generation_kwargs or {}
        if self.repetition_penalty != 1.0 or gk.get("repetition_penalty", 1.0) != 1.0:
            warnings.warn(
                "repetition_penalty: mu (the distribution the generator samples from, penalised) differs from "
                "pi = softmax(logits / T) even with identical weights, so ratios and divergences include that gap "
                "and masks fire on-policy. RL recipes sample with repetition_penalty=1.",
                UserWarning, stacklevel=3)
        samp = spec.sampling
        if not self.use_vllm and samp.min_p is not None and (samp.top_k is not None or samp.top_p is not None):
            warnings.warn(
                "min_p: generate() applies min-p after top-k / top-p, the loss rebuilds the kept set in vLLM's order "
                "(min-p first); where the two sets differ, pdmask/kept_set_sampled_outside_frac and "
                "pdmask/kept_set_topk_mismatch_frac report it. Use min_p alone, or vLLM.",
                UserWarning, stacklevel=3)
