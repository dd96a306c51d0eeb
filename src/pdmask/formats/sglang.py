"""SGLang's ``meta_info`` log-probs -> padded (B, T, K) top-K tensors.

No SGLang import. Formats read (checked against SGLang 0.5.23 source,
``srt/managers/tokenizer_manager.py``, ``srt/layers/sampler.py``), for a request with
``return_logprob=True, top_logprobs_num=K``:

- ``meta_info["output_token_logprobs"]``: one ``(logprob, token_id, text_or_None)`` per
  generated token -- the *sampled* token (lists instead of tuples after JSON).
- ``meta_info["output_top_logprobs"]``: one list per generated token of K
  ``(logprob, token_id, text_or_None)`` sorted by descending log-prob (``torch.topk``),
  or ``None`` for a position without entries. The sampled token is *not* added; it may
  or may not be among them.
- with ``return_flat_raw_output_top_logprobs=True`` instead: ``output_top_logprobs_val_flat``
  / ``output_top_logprobs_idx_flat`` (row-major ``[rows, K]``), ``output_top_logprobs_shape``
  = ``[rows, K]`` and ``output_top_logprobs_null_prefix`` (leading positions without
  rows); with ``return_flat_raw_top_logprobs_b64=True`` the ``*_flat_b64`` fields hold
  base64 little-endian float32 / int32 arrays.

JSON encoders differ on ``-inf``: orjson writes ``null``; a ``None`` top-K log-prob is
read as ``-inf`` (a ``None`` sampled-token log-prob is an error).

Semantics (SGLang's sampler, default settings): the returned log-probs are
``log_softmax(logits / T)`` -- after temperature, *before* top-k / top-p / min-p
truncation (no ``-inf``, no renormalisation). With truncation the reported mu is
therefore not exactly the distribution the token was sampled from
(:func:`check_sglang_semantics` warns). With the environment variable
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` they are taken *before* temperature
(``return_original_logprob=True`` here; warns when T != 1). Greedy requests report
``log_softmax(logits)``.
"""

from __future__ import annotations

import base64
import binascii
import math
import warnings
from collections.abc import Mapping, Sequence

import torch

from . import _check as C
from ..rollout import Rollout
from .topk import assemble, check_k
from .vllm import EngineSemanticsWarning

__all__ = ["Rollout", "check_sglang_semantics", "from_sglang"]


def check_sglang_semantics(
    *,
    temperature: float | None = 1.0,
    top_p: float | None = 1.0,
    top_k: int | None = None,
    min_p: float | None = 0.0,
    return_original_logprob: bool = False,
    stacklevel: int = 2,
) -> None:
    """Warn (:class:`EngineSemanticsWarning`) when SGLang's log-probs are not those of the
    sampling distribution: ``return_original_logprob`` with T != 1, or any top-k / top-p /
    min-p truncation (SGLang reports the untruncated distribution). A setting that is not a
    number (an unconverted string) is a ValueError naming it."""
    T = C.setting("temperature", temperature, 1.0)
    top_p = C.setting("top_p", top_p, None)
    top_k = C.setting("top_k", top_k, None, integer=True)
    min_p = C.setting("min_p", min_p, None)
    if return_original_logprob and T > 0 and abs(T - 1.0) > 1e-6:
        warnings.warn(
            f"SGLANG_RETURN_ORIGINAL_LOGPROB makes SGLang report log_softmax(logits) BEFORE temperature, but the "
            f"tokens were sampled at temperature={T:g}: ratios, divergences and masks would be wrong. Unset it, "
            "or sample at temperature 1.", EngineSemanticsWarning, stacklevel=stacklevel)
    trunc = []
    if top_p is not None and top_p < 1.0:
        trunc.append(f"top_p={top_p:g}")
    if top_k is not None and 0 < top_k < (1 << 30):
        trunc.append(f"top_k={top_k}")
    if min_p is not None and min_p > 0.0:
        trunc.append(f"min_p={min_p:g}")
    if trunc:
        warnings.warn(
            f"SGLang reports log-probs of the distribution before {', '.join(trunc)} truncation, while the tokens "
            "were sampled from the truncated, renormalised one: the rollout log-probs are biased low by the log "
            "of the kept mass. Sample without truncation for RL, or treat the mismatch as part of mu.",
            EngineSemanticsWarning, stacklevel=stacklevel)


def _meta(item, b: int) -> Mapping:
    if isinstance(item, Mapping) and "meta_info" in item:
        if not isinstance(item["meta_info"], Mapping):
            C.fail("results", f"sequence {b}", f"'meta_info' must be a dict, got {type(item['meta_info']).__name__}")
        return item["meta_info"]
    if isinstance(item, Mapping):
        return item
    raise ValueError(f"results: sequence {b}: expected an SGLang result dict (with 'meta_info') or a meta_info "
                     f"dict, got {type(item).__name__}")


def _b64(meta: Mapping, field: str, dtype: torch.dtype, b: int) -> list:
    """A base64 little-endian array; truncated or malformed text is an error naming the field."""
    s = meta[field]
    where = f"sequence {b}"
    if not isinstance(s, (str, bytes)):
        C.fail("results", where, f"meta_info[{field!r}] must be a base64 string, got {type(s).__name__}")
    try:
        raw = bytearray(base64.b64decode(s, validate=True))
    except (binascii.Error, ValueError) as e:
        C.fail("results", where, f"meta_info[{field!r}] is not valid base64 ({e}); truncated?")
    size = torch.empty(0, dtype=dtype).element_size()
    if len(raw) % size:
        C.fail("results", where, f"meta_info[{field!r}] decodes to {len(raw)} bytes, not a whole number of "
                                 f"{size}-byte {str(dtype).removeprefix('torch.')} values; truncated?")
    return torch.frombuffer(raw, dtype=dtype).tolist() if raw else []


def _flat_rows(meta: Mapping, b: int, n_tokens: int):
    """Rows (list per position, or None) from the flat raw output format."""
    where = f"sequence {b}"
    shape = meta["output_top_logprobs_shape"]
    if (not isinstance(shape, (list, tuple)) or len(shape) != 2 or not all(C.is_int(x) and x >= 0 for x in shape)):
        C.fail("results", where, f"meta_info['output_top_logprobs_shape'] must be [rows, K] (two ints >= 0), "
                                 f"got {shape!r}")
    rows, k = int(shape[0]), int(shape[1])
    null = meta.get("output_top_logprobs_null_prefix", 0)
    if not C.is_int(null) or null < 0:
        C.fail("results", where, f"meta_info['output_top_logprobs_null_prefix'] must be an int >= 0, got {null!r}")
    null = int(null)
    if "output_top_logprobs_val_flat_b64" in meta:
        for f, want in (("val", "float32"), ("idx", "int32")):
            got = meta.get(f"output_top_logprobs_{f}_flat_b64_dtype", want)
            if got != want:
                raise ValueError(f"results: sequence {b}: unsupported output_top_logprobs_{f}_flat_b64_dtype {got!r}")
        if "output_top_logprobs_idx_flat_b64" not in meta:
            C.fail("results", where, "meta_info has output_top_logprobs_val_flat_b64 but no "
                                     "output_top_logprobs_idx_flat_b64")
        vals = _b64(meta, "output_top_logprobs_val_flat_b64", torch.float32, b)
        idx = _b64(meta, "output_top_logprobs_idx_flat_b64", torch.int32, b)
    else:
        for f in ("output_top_logprobs_val_flat", "output_top_logprobs_idx_flat"):
            if f not in meta:
                C.fail("results", where, f"meta_info has output_top_logprobs_shape but no {f}")
            C.as_sequence(meta[f], "results", where, f"meta_info[{f!r}] as a list")
        vals, idx = list(meta["output_top_logprobs_val_flat"]), list(meta["output_top_logprobs_idx_flat"])
    if len(vals) != rows * k or len(idx) != rows * k:
        raise ValueError(f"results: sequence {b}: flat top log-probs have {len(vals)} values / {len(idx)} ids, "
                         f"shape says {rows} x {k}")
    if null + rows != n_tokens:
        raise ValueError(f"results: sequence {b}: flat top log-probs cover {null + rows} positions, "
                         f"{n_tokens} tokens were generated")
    out = [None] * null
    for r in range(rows):
        out.append([(vals[r * k + j], idx[r * k + j]) for j in range(k)])
    return out


def _entry(e, b: int, t: int, what: str, k: int | None = None):
    """One ``(logprob, token_id[, text])`` entry, checked: (log-prob or None, id)."""
    where = f"sequence {b}, token {t}"
    field = what if k is None else f"{what} entry {k}"
    if isinstance(e, (str, bytes, Mapping)) or not isinstance(e, Sequence) or len(e) < 2:
        C.fail("results", where, f"{field} must be a (logprob, token_id, text) triple, got {e!r}")
    lp = None if e[0] is None else C.logprob(e[0], "results", where, f"{field}'s log-prob")
    return lp, C.token_id(e[1], "results", where, f"{field}'s token id")


def from_sglang(
    results: Sequence,
    *,
    k: int,
    output_ids: Sequence[Sequence[int]] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    return_original_logprob: bool = False,
    pad_to: int | None = None,
    pad_id: int = 0,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> Rollout:
    """SGLang generate results -> :class:`pdmask.Rollout`.

    Args:
        results: one per sequence: the result dict of ``Engine.generate`` / ``/generate``
            (with ``"meta_info"``, and ``"output_ids"`` when present), or its ``meta_info``.
        k: top-K width (<= ``top_logprobs_num``); 0 returns no top-K.
        output_ids: the sampled ids per sequence, checked against the ids in
            ``output_token_logprobs`` (default: each result's ``"output_ids"`` if present).
        temperature, top_p, top_k, min_p, return_original_logprob: sampling settings for
            :func:`check_sglang_semantics`.

    Naive equivalent, per position t of sequence b (``m = results[b]["meta_info"]``)::

        sampled_logprob, sampled_id, _ = m["output_token_logprobs"][t]
        topk = m["output_top_logprobs"][t][:k]         # (logprob, id, text), descending
    """
    k = check_k(k)
    check_sglang_semantics(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                           return_original_logprob=return_original_logprob, stacklevel=3)
    C.as_sequence(results, "results", "", "a list of SGLang results (one per sequence)")
    if output_ids is not None:
        C.as_sequence(output_ids, "output_ids", "", "one list of token ids per sequence")
        if len(output_ids) != len(results):
            raise ValueError(f"output_ids: {len(output_ids)} sequences but results has {len(results)}")
    pos, ids, lps, ranks = [], [], [], []
    sampled = []
    base = 0
    for b, item in enumerate(results):
        meta = _meta(item, b)
        if "output_token_logprobs" not in meta:
            raise ValueError(f"results: sequence {b} has no meta_info['output_token_logprobs'] "
                             "(request with return_logprob=True)")
        tok = C.as_sequence(meta["output_token_logprobs"], "results", f"sequence {b}",
                            "meta_info['output_token_logprobs'] as a list")
        entries = [_entry(e, b, t, "output_token_logprobs") for t, e in enumerate(tok)]
        s_ids = [i for _, i in entries]
        ref = output_ids[b] if output_ids is not None else (
            item.get("output_ids") if isinstance(item, Mapping) and "meta_info" in item else None)
        if ref is not None and C.token_ids(ref, "output_ids", f"sequence {b}") != s_ids:
            raise ValueError(f"output_ids: sequence {b} does not match the ids in output_token_logprobs")
        if k > 0:
            if "output_top_logprobs_shape" in meta:
                rows = _flat_rows(meta, b, len(tok))
            elif "output_top_logprobs" in meta:
                rows = C.as_sequence(meta["output_top_logprobs"], "results", f"sequence {b}",
                                     "meta_info['output_top_logprobs'] as a list")
                if len(rows) != len(tok):
                    raise ValueError(f"results: sequence {b}: {len(rows)} top-log-prob rows for {len(tok)} tokens")
            else:
                raise ValueError(f"results: sequence {b} has no output_top_logprobs (request with "
                                 f"top_logprobs_num >= {k})")
        else:
            rows = [None] * len(tok)
        for t, (s_lp, s_id) in enumerate(entries):
            if s_lp is None:
                raise ValueError(f"results: sequence {b}, token {t}: the sampled token's log-prob is null")
            row = rows[t] or []
            if k > 0 and not row:
                raise ValueError(f"results: sequence {b}, token {t} has no top log-probs")
            C.as_sequence(row, "results", f"sequence {b}, token {t}", "output_top_logprobs row as a list")
            for j, r in enumerate(row):
                lp, tid = _entry(r, b, t, "output_top_logprobs", j)
                pos.append(base + t)
                ids.append(tid)
                lps.append(-math.inf if lp is None else lp)
                ranks.append(j + 1)
            # the sampled token: ranked after the whole top-K list (it is there only
            # when it is not in the top-K; merged by id otherwise, and its log-prob must
            # then equal its top-K entry's)
            pos.append(base + t)
            ids.append(s_id)
            lps.append(s_lp)
            ranks.append(len(row) + 1)
        sampled.append(s_ids)
        base += len(tok)
    t = (torch.tensor(pos, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64),
         torch.tensor(lps, dtype=torch.float64), torch.tensor(ranks, dtype=torch.int64))
    return assemble(*t, sampled, k=k, arg="results", pad_to=pad_to, pad_id=pad_id, dtype=dtype, device=device)
