"""The tests' flat spelling of a call, packed into the library's typed arguments.

Many numeric tests sweep one keyword at a time (``is_cap``, ``delta_low``,
``sampling_top_p``, ...) over the same tensors; this module packs those flat keywords into
:class:`pdmask.Rollout` and the spec objects (:class:`pdmask.Thresholds`,
:class:`pdmask.Corrections`, :class:`pdmask.Sampling`, :class:`pdmask.Aggregation`,
:class:`pdmask.Compute`) and calls the public function, so that every test goes through the
public API while a sweep stays one line. A keyword this module does not know is passed on
unchanged (``mode``, ``estimator``, ``validate``); ``batch_ddot`` becomes the batch mask's
per-token extra (``extras={"ddot_batch": ...}``).
"""

from __future__ import annotations

import pdmask
from pdmask.corrections import FIELDS as CORRECTION_FIELDS

#: flat keyword -> (spec argument, the spec's field)
SPEC_OF = {
    **{k: ("thresholds", k) for k in ("delta_low", "delta_high", "eps_low", "eps_high", "dual_clip")},
    **{k: ("corrections", k) for k in CORRECTION_FIELDS},
    "temperature": ("sampling", "temperature"),
    "sampling_top_k": ("sampling", "top_k"), "sampling_top_p": ("sampling", "top_p"),
    "sampling_min_p": ("sampling", "min_p"),
    **{k: ("aggregation", k) for k in ("loss_agg", "num_tokens", "num_seqs", "loss_scale_factor", "dp_size")},
    "impl": ("compute", "impl"), "chunk_size": ("compute", "chunk_rows"), "chunk_rows": ("compute", "chunk_rows"),
}
SPEC_CLASS = {"thresholds": pdmask.Thresholds, "corrections": pdmask.Corrections, "sampling": pdmask.Sampling,
              "aggregation": pdmask.Aggregation, "compute": pdmask.Compute}
#: flat keyword -> Rollout field
ROLLOUT_OF = {"sampled_ids": "sampled_ids", "rollout_logprob": "sampled_logprob", "rollout_topk_ids": "topk_ids",
              "rollout_topk_logprobs": "topk_logprobs", "response_mask": "response_mask",
              "rollout_kept_mask": "kept_mask", "rollout_logits": "logits"}
#: the old positional order after the logits
POSITIONAL = ("sampled_ids", "rollout_logprob", "rollout_topk_ids", "rollout_topk_logprobs", "advantages",
              "response_mask")


def specs(**kw) -> dict:
    """Flat keywords -> ``{spec argument: spec object}`` plus the keywords passed on."""
    groups: dict[str, dict] = {}
    out = {}
    for k, v in kw.items():
        if k in SPEC_OF:
            arg, name = SPEC_OF[k]
            groups.setdefault(arg, {})[name] = v
        else:
            out[k] = v
    for arg, fields in groups.items():
        out[arg] = SPEC_CLASS[arg](**fields)
    if out.get("batch_ddot") is not None:  # the batch mask's direction: the per-token extra its modes read
        import pdmask_lab.batchmask

        out["extras"] = {pdmask_lab.batchmask.DDOT: out.pop("batch_ddot")}
    out.pop("batch_ddot", None)
    return out


def split(args, kw, positional=POSITIONAL):
    """``(rollout, advantages, spec keywords)`` from a flat call's arguments."""
    kw = dict(kw)
    for name, v in zip(positional, args):
        kw[name] = v
    r = {ROLLOUT_OF[k]: kw.pop(k) for k in list(kw) if k in ROLLOUT_OF}
    adv = kw.pop("advantages", None)
    return pdmask.Rollout(**r), adv, specs(**kw)


def policy_loss(logits, *args, **kw):
    rollout, adv, rest = split(args, kw)
    return pdmask.policy_loss(logits, rollout, adv, **rest)


def trust_region_mask(logits, *args, **kw):
    rollout, adv, rest = split(args, kw)
    return pdmask.trust_region_mask(logits, rollout, adv, **rest)


def policy_loss_from_hidden(hidden, lm_head_weight, *args, **kw):
    rollout, adv, rest = split(args, kw)
    return pdmask.policy_loss_from_hidden(hidden, lm_head_weight, rollout, adv, **rest)


def token_stats(logits, *args, **kw):
    rollout, _, rest = split(args, kw, POSITIONAL[:4])
    return pdmask.token_stats(logits, rollout, **rest)


def rollout(**kw) -> pdmask.Rollout:
    """A Rollout from the flat tensor names (extra keys ignored)."""
    return pdmask.Rollout(**{ROLLOUT_OF[k]: v for k, v in kw.items() if k in ROLLOUT_OF})


MASK_KEYS = ("input_ids", "attention_mask", "response_mask", "rollout_logprob", "rollout_topk_ids",
             "rollout_topk_logprobs", "advantages")


def mask_args(*args, **kw):
    """The batch mask's flat arguments -> ``(input_ids, attention_mask, rollout, advantages)``
    and the keywords passed on."""
    kw = dict(kw)
    for name, v in zip(MASK_KEYS, args):
        kw[name] = v
    ids, am = kw.pop("input_ids"), kw.pop("attention_mask")
    mask = kw.pop("response_mask")
    T = mask.shape[1] if hasattr(mask, "shape") and mask.dim() == 2 else 1
    r = pdmask.Rollout(ids[:, ids.shape[1] - T:] if hasattr(ids, "shape") and ids.dim() == 2 else ids,
                       kw.pop("rollout_logprob"), kw.pop("rollout_topk_ids"), kw.pop("rollout_topk_logprobs"), mask)
    return (ids, am, r, kw.pop("advantages")), kw


#: the spec arguments the batch mask takes (its ``chunk_size`` is a keyword of its own)
BATCH_SPECS = ("thresholds", "sampling")


def batch_mask(model, *args, **kw):
    """The batch mask with its flat keywords (``delta_low``, ``temperature``) packed into
    :class:`pdmask.Thresholds` / :class:`pdmask.Sampling`."""
    pos, rest = mask_args(*args, **kw)
    from pdmask_lab.batchmask import batch_mask as lab_batch_mask

    packed = {k: v for k, v in rest.items() if SPEC_OF.get(k, ("",))[0] in BATCH_SPECS}
    rest = {k: v for k, v in rest.items() if k not in packed}
    return lab_batch_mask(model, *pos, **rest, **specs(**packed))


def call_mask(bm, *args, **kw):
    pos, rest = mask_args(*args, **kw)
    return bm(*pos, **rest)
