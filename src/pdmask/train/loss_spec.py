"""The trainer's loss spec as a mapping: one :class:`pdmask.PolicyLoss` from config keys.

The loss's settings are the fields of :class:`pdmask.PolicyLoss` and of its specs
(:func:`loss_parts`, :func:`loss_leaves`: read from the dataclasses, so a field added to a
spec is a config key without a line here), as paths (``thresholds.delta_low``). A config
gives some of them (:func:`loss_fields` fills in the rest: the core's defaults and the
trainer's :data:`TRAINER_LOSS_DEFAULTS`); :func:`build_loss` builds the spec once, every
value checked by the spec classes themselves, an error renamed to the key it was given by.
:data:`LOSS_ALIASES` is the one table of the short names of the flat config that came
before. The config itself (:mod:`pdmask.train.config`) holds the result as ``cfg.loss``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing
from collections.abc import Mapping
from typing import Any

from ..corrections import DEFAULT_IS_CAP
from ..corrections import FIELDS as CORRECTION_FIELDS
from .._validate import SpecError
from ..loss import PolicyLoss
from ..masks import MODES, get_mode


#: Short names of loss fields (the names of the flat trainer config before the one spec, in
#: which the run directories of older versions stored their config.yaml): short name ->
#: path in ``loss``. Read wherever a config key is (YAML, ``key=value`` overrides, ladder
#: specs, stored runs); written nowhere: config.yaml holds the nested ``loss`` mapping.
LOSS_ALIASES = {
    "mode": "mode", "estimator": "estimator", "support": "support",
    **{k: f"thresholds.{k}" for k in ("delta_low", "delta_high", "eps_low", "eps_high", "dual_clip")},
    **{k: f"corrections.{k}" for k in CORRECTION_FIELDS},
    "temperature": "sampling.temperature", "sampling_top_k": "sampling.top_k",
    "sampling_top_p": "sampling.top_p", "sampling_min_p": "sampling.min_p",
    "loss_agg": "aggregation.loss_agg", "anchor": "anchor",
}
#: Where the trainer's loss departs from the core's defaults (clip-higher; no data checks
#: on the hot path, whose inputs come from the trainer's own engine).
TRAINER_LOSS_DEFAULTS = {"thresholds.eps_high": 0.28, "validate": False}


@functools.lru_cache(maxsize=None)
def loss_parts() -> dict[str, type | None]:
    """:class:`pdmask.PolicyLoss`'s fields -> the spec class each holds (None: a plain value)."""
    hints = typing.get_type_hints(PolicyLoss)
    out = {}
    for f in dataclasses.fields(PolicyLoss):
        if f.init:
            args = typing.get_args(hints[f.name]) or (hints[f.name],)
            out[f.name] = next((a for a in args if isinstance(a, type) and dataclasses.is_dataclass(a)), None)
    return out


@functools.lru_cache(maxsize=None)
def loss_leaves() -> dict[str, Any]:
    """Every loss field as a path (``mode``, ``thresholds.delta_low``, ...) -> its type hint."""
    out = {}
    top = typing.get_type_hints(PolicyLoss)
    for name, cls in loss_parts().items():
        if cls is None:
            out[name] = top[name]
        else:
            hints = typing.get_type_hints(cls)
            out.update({f"{name}.{f.name}": hints[f.name] for f in dataclasses.fields(cls) if f.init})
    return out


def _default_of(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def loss_fields(given: Mapping | None = None) -> dict[str, Any]:
    """The full nested mapping of the trainer's loss: the core's defaults, the trainer's
    :data:`TRAINER_LOSS_DEFAULTS`, then ``given`` (nested, partial) over them."""
    out: dict[str, Any] = {}
    pl = {f.name: f for f in dataclasses.fields(PolicyLoss)}
    for name, cls in loss_parts().items():
        out[name] = _default_of(pl[name]) if cls is None else {
            f.name: _default_of(f) for f in dataclasses.fields(cls) if f.init}
    for path, v in TRAINER_LOSS_DEFAULTS.items():
        put_path(out, path, v)
    for path, v in flatten_loss(given or {}):
        put_path(out, path, v)
    return out


def spec_fields(spec: PolicyLoss) -> dict[str, Any]:
    """The fields of a built spec as a nested mapping (:func:`spec_fields_of` of each part)."""
    return {name: getattr(spec, name) if cls is None else spec_fields_of(getattr(spec, name))
            for name, cls in loss_parts().items()}


def resolved_fields(spec: PolicyLoss) -> dict[str, Any]:
    """The fields a built spec resolves to, what a run used: the mode's name, the mode's
    deltas where none were given, the IS cap in force (5 where none was given), a mode's
    corrections preset applied (``cispo``'s bounds)."""
    out = spec_fields(spec)
    out["mode"] = get_mode(spec.mode).name
    out["corrections"]["is_cap"] = spec.corrections.is_cap
    return out


#: The config key of :func:`mode_record`: what the run's mode was made of when it ran.
MODE_RECORD = "mode_spec"


def mode_record(spec: PolicyLoss) -> dict[str, Any]:
    """The parts of the spec's mode a run records beside its loss fields (config.yaml's
    ``mode_spec``, summary.json): its surrogate and the divergence it reports and is centred on."""
    return {"surrogate": spec.mask_mode.surrogate, "divergence": spec.mask_mode.divergence}


#: What a record written before issue 42 left implicit, per mode of that time: ``(surrogate,
#: divergence, default delta)``. A ``null`` delta in such a config.yaml / summary.json is the
#: mode's default then, a ``null`` ``is_cap`` :data:`IS_CAP_BEFORE_42`, and the surrogate and
#: divergence were not written. Frozen here, not read from the registry, so that a later change
#: of a default does not change what an old record says (docs/results/README.md).
RECORDED_BEFORE_42 = {
    "grpo": ("ppo-clip", "topk_kl", 0.05), "none": ("dppo", "topk_kl", 0.05),
    "dppo-binary-tv": ("dppo", "binary_tv", 0.15), "dppo-binary-kl": ("dppo", "binary_kl", 0.05),
    "dppo-topk-kl": ("dppo", "topk_kl", 0.05), "dppo-topk-tv": ("dppo", "topk_tv", 0.15),
    "pdm-topk-kl": ("dppo", "topk_kl", 0.05), "pdm-topk-tv": ("dppo", "topk_tv", 0.15),
    "pdm-full-kl": ("dppo", "full_kl", 0.05), "pdm-full-tv": ("dppo", "full_tv", 0.15),
    "drpo": ("drpo", "binary_tv", 0.15), "spo": ("spo", "topk_kl", 0.2),
    "pdm-smooth-topk-kl": ("smooth", "topk_kl", 0.05), "pdm-smooth-topk-tv": ("smooth", "topk_tv", 0.15),
    "pdm-batch-topk-kl": ("dppo", "topk_kl", 0.05), "pdm-batch-topk-tv": ("dppo", "topk_tv", 0.15),
    "pdm-batch-all-topk-kl": ("dppo", "topk_kl", 0.05), "pdm-batch-all-topk-tv": ("dppo", "topk_tv", 0.15),
}
IS_CAP_BEFORE_42 = 5.0


def read_as_recorded(given: Mapping, record: Mapping | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A stored run's loss fields (nested, full) and mode record read as the run used them: an
    older record's ``null`` delta / ``is_cap`` replaced by its value then (:data:`RECORDED_BEFORE_42`)
    and its missing mode record filled in from the same table (None for a mode it does not list)."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in given.items()}
    old = RECORDED_BEFORE_42.get(out.get("mode")) if isinstance(out.get("mode"), str) else None
    if old is not None:
        for k in ("delta_low", "delta_high"):
            if out["thresholds"].get(k) is None:
                out["thresholds"][k] = old[2]
        if out["corrections"].get("is_cap") is None:
            out["corrections"]["is_cap"] = IS_CAP_BEFORE_42
    if record is None and old is not None:
        record = {"surrogate": old[0], "divergence": old[1]}
    return out, None if record is None else dict(record)


def build_loss(fields: Mapping, names: Mapping | None = None) -> tuple[PolicyLoss, dict[str, Any]]:
    """``(spec, fields)``: the :class:`pdmask.PolicyLoss` of a full nested mapping
    (:func:`loss_fields`) and its fields as given, in canonical form (the specs' own
    normalisation: ``top_k`` 0 is None, numbers are floats). Every check is the specs'
    own; an error names the key as the user wrote it (``names``: path -> key; else the
    field's short name, else ``loss.<path>``)."""
    parts = {}
    try:
        for name, cls in loss_parts().items():
            if cls is not None:
                parts[name] = cls(**fields[name])
        top = {name: fields[name] for name, cls in loss_parts().items() if cls is None}
        spec = PolicyLoss(**top, **parts)
    except ValueError as e:
        raise _renamed(e, names or {}) from None
    canonical = {name: top[name] if cls is None else spec_fields_of(parts[name])
                 for name, cls in loss_parts().items()}
    return spec, canonical


def spec_fields_of(obj) -> dict[str, Any]:
    """One spec's init fields; a field whose ``<name>_given`` flag says it was not given is
    None (``Corrections.is_cap``: None stands for the default 5)."""
    return {f.name: None if getattr(obj, f"{f.name}_given", True) is False else getattr(obj, f.name)
            for f in dataclasses.fields(obj) if f.init}


def _renamed(e: ValueError, names: Mapping) -> ValueError:
    """A spec's error (:class:`pdmask.SpecError`, which names its field) with the field named as
    the config key it came from; another error as it is. An unknown mode adds where the modes
    a package registers come from (the ``pdm-batch-*`` modes: :mod:`pdmask_lab.batchmask`)."""
    if not isinstance(e, SpecError):
        return e
    path = e.field if e.field in loss_leaves() else {p.rsplit('.', 1)[-1]: p for p in loss_leaves()}.get(e.field)
    if path is None:
        return e
    if path == "mode" and e.problem.startswith("unknown value"):
        e = SpecError(e.field, f"{e.problem} (a package's own modes are registered when it is imported: "
                               "pdmask_lab.batchmask for pdm-batch-*, which the pdmask command line imports)")
    return e.renamed(names.get(path) or key_of(path))


def key_of(path: str) -> str:
    """The key a loss field not written by the user is named by: its short name, else ``loss.<path>``."""
    return next((k for k, v in LOSS_ALIASES.items() if v == path), f"loss.{path}")


def flatten_loss(m: Mapping, prefix: str = "") -> list[tuple[str, Any]]:
    """``(path, value)`` of a nested mapping of loss fields (``{"thresholds": {"delta_low": x}}``
    -> ``("thresholds.delta_low", x)``); an unknown key raises, naming it."""
    out = []
    for k, v in m.items():
        path = f"{prefix}{k}"
        if isinstance(v, Mapping) and path in loss_parts() and loss_parts()[path] is not None:
            out += flatten_loss(v, f"{path}.")
        elif path in loss_leaves():
            out.append((path, v))
        else:
            close = difflib.get_close_matches(f"loss.{path}", [f"loss.{p}" for p in loss_leaves()], n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(f"loss.{path}: unknown loss field{hint}; pdmask train --help-config lists them")
    return out


def put_path(d: dict, path: str, value) -> None:
    *head, last = path.split(".")
    for h in head:
        d = d.setdefault(h, {})
    d[last] = value


def plain(x):
    """A YAML/JSON-ready copy (tuples as lists)."""
    if isinstance(x, Mapping):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x


def loss_help() -> dict[str, str]:
    """:data:`LOSS_HELP` with the modes and their default deltas read from the registry now."""
    modes = ", ".join(f"{n} ({m.default_delta:g})" for n, m in MODES.items())
    return {**LOSS_HELP, "mode": f"mask mode from pdmask.MODES, with its default delta: {modes}"}


#: One line per loss field for ``--help-config`` (the full meaning is in the spec classes'
#: docstrings and docs/core.md); the mode's line is :func:`loss_help`'s.
LOSS_HELP = {
    "mode": "mask mode from pdmask.MODES (pdmask train --help-config lists them)",
    "estimator": "top-K tail estimator of Ddot: exact, aggregated, uniform, truncated",
    "support": "support of the top-K divergences: topk+sampled (top-K plus the sampled token) or topk (the DPPO "
               "reference code); not with the pdm-batch-* modes",
    "validate": "check the loss inputs' values (one host sync per mini-batch)",
    "thresholds.delta_low": "divergence threshold for A < 0, the smooth modes' scale delta (null: the mode's)",
    "thresholds.delta_high": "divergence threshold for A > 0, the smooth modes' scale delta (null: the mode's)",
    "thresholds.eps_low": "grpo ratio clip below 1",
    "thresholds.eps_high": "grpo ratio clip above 1 (clip-higher; the trainer's default 0.28)",
    "thresholds.dual_clip": "grpo only: the loss of an A < 0 token is at most -A C (null: is_cap; .inf disables)",
    "corrections.is_level": "IS weight: token (r), sequence (prod r) or null (none); verl rollout_is",
    "corrections.is_cap": "IS-weight cap C in min(r, C) and upper bound of is_mask (null: the default, "
                          f"{DEFAULT_IS_CAP:g}; .inf disables)",
    "corrections.is_floor": "lower bound of the IS weight (null: none)",
    "corrections.is_mask": "mask outside [is_floor, is_cap] (MIS, IcePop) instead of truncating (TIS)",
    "corrections.is_batch_normalize": "divide the IS weights by their batch mean (verl)",
    "corrections.rejection": "rejection rules, comma-separated (token_k1..3, seq_sum_k1..3, seq_mean_k1..3, "
                             "seq_max_k2/3); verl rollout_rs",
    "corrections.rejection_threshold": "their thresholds in verl's syntax (one value, or one per rule, lo_hi for k1)",
    "corrections.off_policy_mask_threshold": "mask sequences with A < 0 and mean log(mu/pi) above it (null: off)",
    "sampling.temperature": "sampling temperature of the engine; the loss uses pi = softmax(logits / temperature)",
    "sampling.top_k": "engine samples from its k most likely tokens (null: off); the loss renormalises pi over the "
                      "same kept set",
    "sampling.top_p": "engine samples from the smallest set holding top_p of the mass (null: off; vLLM's order)",
    "sampling.min_p": "engine drops tokens below min_p x the top probability (null: off)",
    "aggregation.loss_agg": "loss aggregation (verl's agg_loss modes): token-mean, token-sum, seq-mean-token-mean, "
                            "seq-mean-token-sum, seq-mean-token-sum-norm",
    "aggregation.num_tokens": "token-mean's global token count (null: the batch's own)",
    "aggregation.num_seqs": "the seq-mean modes' global sequence count (null: the batch's own)",
    "aggregation.loss_scale_factor": "seq-mean-token-sum-norm's T (null: the batch's length)",
    "aggregation.dp_size": "data-parallel world size the loss is multiplied by (1 in the built-in trainer)",
    "compute.impl": "how the vocabulary reductions run: auto, torch, triton, reference",
    "compute.chunk_rows": "rows per chunk of the vocabulary reductions (null: the implementation's default)",
    "compute.chunk_cols": "vocabulary columns per chunk from hidden states (null: 4 M logits)",
}


def loss_path(key: str) -> str | None:
    """The loss field a config key names (``delta_low`` -> ``thresholds.delta_low``), None for other keys."""
    if key in LOSS_ALIASES:
        return LOSS_ALIASES[key]
    return key[5:] if key.startswith("loss.") and key[5:] in loss_leaves() else None


def coerce_leaf(path: str, value: Any) -> Any:
    """A loss field's value from YAML: an empty string is null for a field that takes null
    (the flat config's ``rejection: ''``), numbers are floats where the field holds floats
    (``3e-4`` and ``inf`` from text too). Everything else is the spec's to check."""
    args = typing.get_args(loss_leaves()[path]) or (loss_leaves()[path],)
    if value == "" and (type(None) in args or object in args):
        return None
    if float in args and int not in args:
        value = yaml_number(value)
        if isinstance(value, str) and value.strip().lower() in ("inf", ".inf", "infinity"):
            return math.inf
        if isinstance(value, int) and not isinstance(value, bool):
            return float(value)
    return value


def yaml_number(value):
    """PyYAML reads ``3e-4`` (no dot) as a string; accept it as a float."""
    if isinstance(value, str):
        try:
            return float(value) if any(c in value.lower() for c in "e.") else value
        except ValueError:
            return value
    return value
