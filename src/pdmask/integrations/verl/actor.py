"""Actor side of the top-K modes: per-token statistics from the trainer's logits.

verl 0.9.1's FSDP engine (``verl/workers/engine/fsdp/transformer_impl.py:
FSDPEngineWithLMHead.prepare_model_outputs``) hands the temperature-scaled logits of a
micro-batch to the *loss function* when the micro-batch carries the non-tensor flag
``distillation_use_topk``::

    outputs = logits_processor_func(student_logits=logits_rmpad.unsqueeze(0), data=micro_batch)
    # each value (1, rows): gathered over Ulysses SP, unpadded, stored as model_output[key]

That hook exists for top-K distillation; the trainer sets the flag only from the
distillation config. :class:`.training_engine.PdmaskFSDPEngine` (registered in verl's
``EngineRegistry`` as model type ``pdmask_language_model``) sets it on micro-batches that carry the rollout
top-K and wraps the loss function in :class:`PdmaskLossFunction`, which

1. as the logits processor: aligns the rollout top-K (per-sample arrays the
   :mod:`.rollout` replica put in ``extra_fields``, see :func:`sample_arrays` for where
   each trainer path leaves them) with the packed logits rows and calls
   :func:`pdmask.token_stats` on them (the only place that reads (N, V));
2. as the loss: turns the statistics into (B, T) response tensors with verl's own
   ``no_padding_2_padding`` (the same alignment as ``log_probs``) and calls verl's
   ``ppo_loss`` inside :func:`.losses.rollout_stats`, so the registered pdmask loss
   sees them; entropy/KL terms, metrics and aggregation stay verl's.

Decoupled mode (``algorithm.rollout_correction.bypass_mode=false``, v1 trainer): the
old-log-prob pass (``compute_log_prob``, no loss function, ``calculate_entropy`` set) of a
batch that carries the rollout top-K gets the same hook with :class:`OldPolicyCapture`, which
stores pi_old's log-probs at the sampled ids and at the engine's top-K ids as per-row outputs
(``pdmask_old_sampled_logprob``, ``pdmask_old_topk_<j>``: the hook takes one (rows,) tensor
per key). verl writes every output of that pass to TransferQueue, so they reach the training
micro-batches of the same samples, where :func:`logits_to_stats` measures the statistics
against pi_old (:class:`pdmask.Anchor`) and ships mu's log-prob and ``D(mu, pi_old)`` with
them (:func:`.losses.topk_stats`). Other micro-batches without a loss function (reference
pass, validation) go through the stock engine unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from ...anchor import Anchor, anchor_distance
from ...rollout import Rollout
from ...stats import token_stats
from .losses import anchor_distances, engine_without_topk, rollout_stats, shipped
from .rollout import EXTRA_KEYS

MODEL_TYPE = "pdmask_language_model"
#: model_output keys the logits processor adds (prefixed to avoid clashes).
OUT_PREFIX = "pdmask_"
#: the old-log-prob pass's outputs (decoupled mode): pi_old at the sampled ids, and at top-K id j
OLD_SAMPLED = "pdmask_old_sampled_logprob"
OLD_TOPK = "pdmask_old_topk_"
#: elements of one float32 (rows, V) block of the old-log-prob pass's log-softmax
CHUNK_ELEMENTS = 1 << 24


#: Non-tensor key under which verl's v1 trainer carries each sample's ``extra_fields`` dict.
EXTRA_FIELDS = "extra_fields"


def _extra_field_dicts(data) -> list | None:
    """The per-sample ``extra_fields`` dicts of a v1 micro-batch (None when absent)."""
    from verl.utils import tensordict_utils as tu

    if EXTRA_FIELDS not in data.keys():
        return None
    vals = tu.get(data, EXTRA_FIELDS)
    return list(vals) if isinstance(vals, (list, tuple)) else None


def has_rollout_topk(data) -> bool:
    """True when a micro-batch carries the replica's per-sample top-K arrays (either path,
    see :func:`sample_arrays`)."""
    if all(k in data.keys() for k in EXTRA_KEYS):
        return True
    extras = _extra_field_dicts(data)
    return bool(extras) and any(isinstance(e, dict) and all(k in e for k in EXTRA_KEYS) for e in extras)


def sample_arrays(data, key: str) -> list[np.ndarray]:
    """One of the replica's arrays (:data:`.rollout.EXTRA_KEYS`) for every sample of a micro-batch.

    The replica puts the arrays in ``TokenOutput.extra_fields``; the agent loop copies that
    dict into ``AgentLoopOutput.extra_fields``. From there verl 0.9.1 has two paths:

    - legacy trainer (``trainer.use_v1=false``): ``AgentLoopWorker._postprocess`` turns
      every key of ``extra_fields`` into its own per-sample object array of
      ``non_tensor_batch``, so each array arrives as a top-level non-tensor key;
    - v1 trainer (``trainer.use_v1=true``, verl's default): ``AgentLoopOutput.as_dict``
      lifts only the teacher fields out of ``extra_fields`` and stores the rest as one
      per-sample dict under ``extra_fields`` (``list_of_dict_to_tensordict`` ->
      TransferQueue -> the actor's micro-batch), so the arrays arrive inside those dicts.

    Both are read here, the top-level key first.
    """
    from verl.utils import tensordict_utils as tu

    vals = tu.get(data, key) if key in data.keys() else None
    if vals is None:
        extras = _extra_field_dicts(data)
        if extras is not None:
            vals = [e.get(key) if isinstance(e, dict) else None for e in extras]
    if vals is None or any(v is None for v in vals):
        raise ValueError(f"{key}: missing for some samples (was every response generated by the "
                         "pdmask_vllm rollout? multi-turn agent loops keep only the first turn's fields)")
    return [np.asarray(v) for v in vals]


def response_rows(data) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed row of every response position, as verl aligns ``log_probs``.

    Returns ``(rows (B, T) int64, valid (B, T) bool)``: the logits row that predicts
    response token t of sample b (``valid`` False on padding). Computed by running
    verl's ``no_padding_2_padding`` on ``arange(1, N + 1)``, so it is by construction
    the alignment verl uses for ``log_probs``.
    """
    from verl.workers.utils.padding import no_padding_2_padding

    input_ids = data["input_ids"]
    n = int(input_ids.offsets()[-1])
    pos1 = torch.arange(1, n + 1, device=input_ids.values().device)
    idx = no_padding_2_padding(pos1, data)  # (B, T), 0 on padding
    return (idx - 1).clamp(min=0), idx > 0


def pack_rollout_topk(data) -> dict[str, torch.Tensor]:
    """Per-sample rollout arrays -> packed (N, ...) tensors aligned with the logits rows.

    Returns ``topk_ids (N, K)``, ``topk_logprobs (N, K)``, ``sampled_logprob (N,)``,
    ``sampled_ids (N,)`` (the rollout's own record, for an alignment check) and
    ``valid (N,)`` bool (rows predicting a response token that the rollout generated).
    """
    rows, valid = response_rows(data)
    device = rows.device
    n = int(data["input_ids"].offsets()[-1])
    arrs = {k: sample_arrays(data, k) for k in EXTRA_KEYS}
    ids_l, lps_l, sid_l, slp_l = (arrs[k] for k in EXTRA_KEYS)
    B = rows.shape[0]
    if len(ids_l) != B:
        raise ValueError(f"{EXTRA_KEYS[0]}: {len(ids_l)} samples in a micro-batch of {B}")
    K = ids_l[0].shape[-1]
    lens = valid.sum(-1).tolist()
    sel_rows, ids_c, lps_c, sid_c, slp_c = [], [], [], [], []
    for b in range(B):
        L = lens[b]
        if ids_l[b].ndim != 2 or ids_l[b].shape[-1] != K:
            raise ValueError(f"{EXTRA_KEYS[0]}: sample {b} has shape {ids_l[b].shape}, expected (T, {K})")
        if ids_l[b].shape[0] < L:
            raise ValueError(f"{EXTRA_KEYS[0]}: sample {b} has top-K for {ids_l[b].shape[0]} tokens but its "
                             f"response has {L} (multi-turn responses are not supported)")
        sel_rows.append(rows[b, :L])
        ids_c.append(torch.as_tensor(ids_l[b][:L], dtype=torch.int64))
        lps_c.append(torch.as_tensor(lps_l[b][:L], dtype=torch.float32))
        sid_c.append(torch.as_tensor(sid_l[b][:L], dtype=torch.int64))
        slp_c.append(torch.as_tensor(slp_l[b][:L], dtype=torch.float32))
    r = torch.cat(sel_rows)
    out = {
        "topk_ids": torch.zeros(n, K, dtype=torch.int64, device=device),
        "topk_logprobs": torch.zeros(n, K, dtype=torch.float32, device=device),
        "sampled_logprob": torch.zeros(n, dtype=torch.float32, device=device),
        "sampled_ids": torch.zeros(n, dtype=torch.int64, device=device),
        "valid": torch.zeros(n, dtype=torch.bool, device=device),
    }
    out["topk_ids"][r] = torch.cat(ids_c).to(device)
    out["topk_logprobs"][r] = torch.cat(lps_c).to(device)
    out["sampled_logprob"][r] = torch.cat(slp_c).to(device)
    out["sampled_ids"][r] = torch.cat(sid_c).to(device)
    out["valid"][r] = True
    return out


def _sp_slice(x: torch.Tensor) -> torch.Tensor:
    """This rank's Ulysses shard of a packed (N, ...) tensor (verl's teacher-tensor rule)."""
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size, slice_input_tensor

    if get_ulysses_sequence_parallel_world_size() > 1:
        return slice_input_tensor(x.unsqueeze(0), dim=1).squeeze(0)
    return x


def _local_rollout(logits: torch.Tensor, data, validate: bool) -> tuple[dict, Rollout, torch.Tensor]:
    """This rank's packed rollout arrays, checked against the logits rows and the batch's
    tokens, as ``(arrays, the (1, rows) Rollout of mu, valid (rows,))``."""
    packed = pack_rollout_topk(data)
    input_ids = data["input_ids"]
    next_ids = torch.roll(input_ids.values(), shifts=-1, dims=0)  # the token each row predicts
    packed["next_ids"] = next_ids.to(packed["topk_ids"].device)
    local = {k: _sp_slice(v) for k, v in packed.items()}
    rows = logits.shape[0]
    if local["valid"].shape[0] != rows:
        raise ValueError(
            f"student_logits: {rows} packed rows but the micro-batch has {local['valid'].shape[0]} on this rank "
            "(pad_to_length is not supported with the pdmask top-K modes)")
    valid = local["valid"].to(logits.device)
    if validate and bool(((local["sampled_ids"] != local["next_ids"]) & local["valid"]).any()):
        raise ValueError("pdmask_sampled_ids: the rollout's sampled tokens do not match the response tokens "
                         "of the batch (misaligned top-K; multi-turn or re-tokenised responses?)")
    dev = logits.device
    rollout = Rollout(sampled_ids=local["next_ids"][None].to(dev), sampled_logprob=local["sampled_logprob"][None].to(dev),
                      topk_ids=local["topk_ids"][None].to(dev), topk_logprobs=local["topk_logprobs"][None].to(dev),
                      response_mask=valid[None])
    return local, rollout, valid


def old_topk_count(data) -> int:
    """K of the pi_old top-K outputs a micro-batch carries (0: none, the rollout anchor)."""
    k = 0
    while f"{OLD_TOPK}{k}" in data.keys():
        k += 1
    return k


def _old_anchor(data, K: int, dev) -> Anchor:
    """pi_old's (1, rows) log-probs from the old-log-prob pass's outputs in the micro-batch
    (nested per sample over prompt + response, packed in the order of the logits rows)."""
    def packed(key):
        return _sp_slice(data[key].values().to(dev).float())

    return Anchor(packed(OLD_SAMPLED)[None], torch.stack([packed(f"{OLD_TOPK}{j}") for j in range(K)], -1)[None])


def logits_to_stats(student_logits: torch.Tensor, data, *, validate: bool = True) -> dict[str, torch.Tensor]:
    """The logits processor: (1, rows, V) temperature-scaled logits -> dict of (1, rows) stats.

    Rows are this rank's packed positions (prompt and response tokens of every sample);
    statistics are computed on response rows and are 0 elsewhere. The logits are
    detached: the gradient flows through verl's own ``log_probs``, the statistics only
    decide the mask. When the micro-batch carries pi_old's top-K (decoupled mode) the
    statistics are against pi_old, and ``D(mu, pi_old)`` is shipped too
    (:func:`.losses.anchor_distances`); ``sampled_logprob`` is always mu's.
    """
    logits = student_logits.squeeze(0).detach()  # (rows, V)
    _, rollout, valid = _local_rollout(logits, data, validate)
    K = old_topk_count(data)
    anchored = rollout
    if K:
        if K != rollout.topk_ids.shape[-1]:
            raise ValueError(f"{OLD_TOPK}*: pi_old's top-K has {K} columns, the rollout's {rollout.topk_ids.shape[-1]}")
        anchored = _old_anchor(data, K, logits.device).rollout_for(rollout)
    # the logits arrive temperature-scaled: the statistics are those at temperature 1
    st = token_stats(logits[None], anchored, validate=validate)
    ship = {k: st[k] for k in shipped()}
    ship["sampled_logprob"] = rollout.sampled_logprob  # mu: the behaviour side of an anchored loss
    for name, div in anchor_distances().items() if K else ():  # the loss mode is not known here: each
        ship[name] = anchor_distance(div, anchored, rollout, valid[None], logits.shape[-1])
    out = {}
    for k, v in ship.items():  # each Ddot computed here (the loss mode is not known to the hook)
        out[OUT_PREFIX + k] = torch.where(valid[None], v.to(torch.float32), torch.zeros_like(v, dtype=torch.float32))
    return out


def logits_to_old_policy(student_logits: torch.Tensor, data, *, validate: bool = True) -> dict[str, torch.Tensor]:
    """The old-log-prob pass's logits processor: pi_old's (1, rows) log-probs at the sampled
    ids (:data:`OLD_SAMPLED`) and at each of the engine's top-K ids (:data:`OLD_TOPK` + j), 0
    on rows that predict no response token. Naive torch (``z`` the temperature-scaled logits):
    ``lq = log_softmax(z, -1); lq.gather(-1, next_ids[:, None]), lq.gather(-1, topk_ids)``."""
    logits = student_logits.squeeze(0).detach()
    _, rollout, valid = _local_rollout(logits, data, validate)
    rows = max(1, CHUNK_ELEMENTS // logits.shape[-1])  # a float32 (rows, V) block at a time, not all rows
    parts = [Anchor.from_logits(logits[None, s:s + rows], rollout[:, s:s + rows], temperature=1.0)  # T applied
             for s in range(0, logits.shape[0], rows)]
    lp = torch.cat([a.sampled_logprob for a in parts], 1).float()
    tk = torch.cat([a.topk_logprobs for a in parts], 1).float()
    zero = torch.zeros((), dtype=torch.float32, device=logits.device)
    out = {OLD_SAMPLED: torch.where(valid[None], lp, zero)}
    for j in range(tk.shape[-1]):
        out[f"{OLD_TOPK}{j}"] = torch.where(valid[None], tk[..., j], zero)
    return out


class PdmaskLossFunction:
    """Wraps the worker's loss function (``partial(ppo_loss, config=actor_config)``).

    verl calls the same object twice per micro-batch: as the logits processor
    (``student_logits=``, ``data=``) and as the loss (``model_output=``, ``data=``,
    ``dp_group=``); see the module docstring.
    """

    def __init__(self, inner: Callable):
        self.inner = inner

    def __call__(self, model_output: dict | None = None, data=None, dp_group=None,
                 student_logits: torch.Tensor | None = None, **kwargs) -> Any:
        if student_logits is not None:
            return logits_to_stats(student_logits, data)
        from verl.workers.utils.padding import no_padding_2_padding

        stats, distances = {}, anchor_distances()
        for k in shipped() + tuple(distances):
            v = model_output.pop(OUT_PREFIX + k, None)
            if v is None and k in distances:
                continue  # the rollout anchor: no pi_old in the micro-batch
            if v is None:
                raise ValueError(f"model_output: {OUT_PREFIX + k!r} missing (logits processor did not run; "
                                 "use_fused_kernels must be false)")
            stats[k] = no_padding_2_padding(v, data)  # (B, T), same alignment as log_probs
        with rollout_stats(stats):
            return self.inner(model_output=model_output, data=data, dp_group=dp_group, **kwargs)


class OldPolicyCapture:
    """The "loss function" of a decoupled-mode old-log-prob pass (verl passes none there): as
    the logits processor, :func:`logits_to_old_policy`; as the loss, a 0 with no metrics (the
    pass computes no loss: ``compute_loss=False``)."""

    def __call__(self, model_output: dict | None = None, data=None, dp_group=None,
                 student_logits: torch.Tensor | None = None, **kwargs) -> Any:
        if student_logits is not None:
            return logits_to_old_policy(student_logits, data)
        return torch.zeros(()), {}


class NoTopKLossFunction:
    """Wraps the worker's loss function on a training micro-batch that carries no rollout
    top-K: the loss runs unchanged (the binary modes need nothing more); a top-K loss then
    fails with a message naming the rollout setting instead of the engine."""

    def __init__(self, inner: Callable):
        self.inner = inner

    def __call__(self, *args, **kwargs) -> Any:
        with engine_without_topk():
            return self.inner(*args, **kwargs)
