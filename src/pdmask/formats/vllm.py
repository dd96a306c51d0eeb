"""vLLM's per-token log-probs -> padded (B, T, K) top-K tensors for :func:`pdmask.policy_loss`.

No vLLM import: every function duck-types vLLM's objects, so this module works (and is
tested) without vLLM installed. Formats read (checked against vLLM 0.32 source,
``vllm/logprobs.py``, ``vllm/v1/sample/sampler.py``):

- ``CompletionOutput.logprobs`` as ``list[dict[int, Logprob]]``: one dict per generated
  token; ``Logprob(logprob: float, rank: int | None, decoded_token: str | None)``. The
  sampler returns the sampled token first, then the top-K in rank order (ranks 1..K);
  the dict merges the two when the sampled token is in the top-K, so a position has K
  or K + 1 entries. The sampled token's ``rank`` is the number of tokens whose log-prob
  is >= its own, so a sampled token outside the top-K always has rank > K.
- ``FlatLogprobs`` (``SamplingParams(flat_logprobs=True)``): parallel lists
  ``token_ids, logprobs, ranks, decoded_tokens`` with per-position
  ``start_indices / end_indices``. Nothing is merged: a position has K + 1 entries and
  the sampled token appears twice when it is in the top-K.
- TRL's rank-sorted lists (``trl.generation``'s ``logprobs`` / ``logprob_token_ids``,
  also what its vLLM server client returns): per position a list sorted by rank or by
  descending log-prob, the sampled token merged in (K or K + 1 entries), no ranks.
  TRL 1.16's ``GRPOTrainer`` keeps ``lp[0]``: the rank-1 token's log-prob, which equals
  the sampled token's only when the sampled token is the most likely one.

Semantics (``logprobs_mode``, an engine-level setting, ``LLM(..., logprobs_mode=...)`` /
``vllm serve --logprobs-mode``): ``raw_logprobs`` (vLLM's default) is
``log_softmax(logits)`` before temperature, penalties and top-k/top-p;
``processed_logprobs`` is after all of them: ``log_softmax(logits / T)`` with the
truncated tokens at ``-inf`` and the kept mass renormalised to 1 -- the distribution the
token was actually sampled from, which is what the trust region must be anchored to.
``raw_logits`` / ``processed_logits`` return logits and are rejected. See
``docs/engine_formats.md``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import torch

from . import _check as C
from .._validate import check_choice
from ..rollout import Rollout
from .topk import assemble, check_k

__all__ = [
    "EngineSemanticsWarning", "LOGPROBS_MODES", "Rollout", "check_sampling_semantics",
    "from_vllm_logprobs", "from_vllm_outputs", "from_ranked_lists", "logprobs_mode_of",
]

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


class EngineSemanticsWarning(UserWarning):
    """The engine's log-probs are not those of the distribution the tokens were sampled from."""


# ---------------------------------------------------------------- semantics
def check_sampling_semantics(
    *,
    logprobs_mode: str | None,
    temperature: float | None = 1.0,
    top_p: float | None = 1.0,
    top_k: int | None = None,
    min_p: float | None = 0.0,
    repetition_penalty: float | None = 1.0,
    engine: str = "vLLM",
    stacklevel: int = 2,
) -> None:
    """Warn when the reported log-probs are not those of the sampling distribution.

    - ``logprobs_mode`` None: unknown, nothing to check.
    - ``raw_logits`` / ``processed_logits``: ``ValueError`` (they are logits).
    - ``raw_logprobs`` with ``temperature`` not 1 (and > 0): :class:`EngineSemanticsWarning`:
      the engine reports ``softmax(logits)`` but sampled from ``softmax(logits / T)``, so
      every ratio and divergence would be measured against the wrong mu.
    - ``raw_logprobs`` with top-k / top-p / min-p truncation or a repetition penalty:
      :class:`EngineSemanticsWarning`: the reported mu ignores the truncation the sampler
      applied (and the penalty).
    - ``processed_logprobs``: fine; truncated tokens come back as ``-inf`` and the kept
      mass is renormalised (documented, not warned).

    A setting that is not a number (an unconverted string, a bool, NaN) is a ValueError
    naming it, in every mode.
    """
    T = C.setting("temperature", temperature, 1.0)  # each setting a number, whatever the mode
    top_p, min_p = C.setting("top_p", top_p, 1.0), C.setting("min_p", min_p, 0.0)
    top_k = C.setting("top_k", top_k, None, integer=True)
    repetition_penalty = C.setting("repetition_penalty", repetition_penalty, 1.0)
    if logprobs_mode is None:
        return
    check_choice("logprobs_mode", logprobs_mode, LOGPROBS_MODES)
    if logprobs_mode.endswith("_logits"):
        raise ValueError(
            f"logprobs_mode: {logprobs_mode!r} makes {engine} return logits, not log-probs; "
            "start the engine with logprobs_mode='processed_logprobs'")
    if logprobs_mode != "raw_logprobs":
        return
    if T > 0 and abs(T - 1.0) > 1e-6:
        warnings.warn(
            f"{engine} logprobs_mode='raw_logprobs' reports log_softmax(logits) BEFORE temperature, but the "
            f"tokens were sampled at temperature={T:g}: the rollout log-probs are not those of the sampling "
            "distribution, so ratios, divergences and masks would be wrong. Start the engine with "
            "logprobs_mode='processed_logprobs' (vllm serve --logprobs-mode processed_logprobs), or sample "
            "at temperature 1.", EngineSemanticsWarning, stacklevel=stacklevel)
    trunc = []
    if top_p < 1.0:
        trunc.append(f"top_p={top_p:g}")
    if top_k is not None and top_k > 0:
        trunc.append(f"top_k={top_k}")
    if min_p > 0.0:
        trunc.append(f"min_p={min_p:g}")
    if abs(repetition_penalty - 1.0) > 1e-6:
        trunc.append(f"repetition_penalty={repetition_penalty:g}")
    if trunc:
        warnings.warn(
            f"{engine} logprobs_mode='raw_logprobs' ignores {', '.join(trunc)}: the reported log-probs are "
            "those of the untruncated distribution, not of the one the tokens were sampled from. Use "
            "logprobs_mode='processed_logprobs'.", EngineSemanticsWarning, stacklevel=stacklevel)


def logprobs_mode_of(llm) -> str | None:
    """The ``logprobs_mode`` of a ``vllm.LLM`` (or its engine / ``ModelConfig``), or None."""
    for path in (("model_config",), ("llm_engine", "model_config"), ("vllm_config", "model_config"), ()):
        obj = llm
        for name in path:
            obj = getattr(obj, name, None)
            if obj is None:
                break
        mode = getattr(obj, "logprobs_mode", None) if obj is not None else None
        if mode is not None:
            return getattr(mode, "value", mode)  # older vLLM: an Enum
    return None


def _sampling_fields(sampling_params):
    sp = sampling_params
    return dict(temperature=getattr(sp, "temperature", 1.0), top_p=getattr(sp, "top_p", 1.0),
                top_k=getattr(sp, "top_k", None), min_p=getattr(sp, "min_p", 0.0),
                repetition_penalty=getattr(sp, "repetition_penalty", 1.0))


# ---------------------------------------------------------------- flattening
def _is_flat(x) -> bool:
    return all(hasattr(x, a) for a in ("start_indices", "end_indices", "token_ids", "logprobs", "ranks"))


def _rank(r, arg: str, where: str) -> int:
    if r is None:
        return -1
    if not C.is_int(r):
        C.fail(arg, where, f"rank must be an int or None, got {r!r} ({type(r).__name__})")
    return int(r)


def _flat_seq(seq_lp, n_tokens: int, b: int, arg: str, base: int):
    """A ``FlatLogprobs`` -> entry tensors, without a Python loop over entries (the fields
    are checked vectorised; a per-element scan runs only to name a bad element)."""
    seq = f"sequence {b}"
    starts = C.int_tensor(seq_lp.start_indices, arg, "FlatLogprobs.start_indices", lambda t: f"{seq}, token {t}")
    ends = C.int_tensor(seq_lp.end_indices, arg, "FlatLogprobs.end_indices", lambda t: f"{seq}, token {t}")
    if starts.numel() != n_tokens or ends.numel() != n_tokens:
        C.fail(arg, seq, f"FlatLogprobs has {starts.numel()} start_indices and {ends.numel()} end_indices "
                         f"for {n_tokens} completion tokens")
    E = len(seq_lp.logprobs)
    for name in ("token_ids", "ranks"):
        if len(getattr(seq_lp, name)) != E:
            C.fail(arg, seq, f"FlatLogprobs.{name} has {len(getattr(seq_lp, name))} entries, "
                             f"FlatLogprobs.logprobs {E}")
    counts = ends - starts  # (T,)
    bad = (counts < 0) | (ends > E)
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        C.fail(arg, f"{seq}, token {t}", f"FlatLogprobs range [{int(starts[t])}, {int(ends[t])}) is not inside "
                                         f"the {E} entries")

    def where(i: int) -> str:  # the position an entry index belongs to
        hit = ((starts <= i) & (i < ends)).nonzero()
        return f"{seq}, token {int(hit[0, 0])}" if hit.numel() else f"{seq}, entry {i} (in no position's range)"

    pos = base + torch.repeat_interleave(torch.arange(n_tokens), counts)
    first = torch.cumsum(counts, 0) - counts
    idx = torch.repeat_interleave(starts - first, counts) + torch.arange(int(counts.sum()))  # (E,)
    ids = C.int_tensor(seq_lp.token_ids, arg, "FlatLogprobs.token_ids", where)[idx]
    lps = C.float_tensor(seq_lp.logprobs, arg, "FlatLogprobs.logprobs", where)[idx]
    ranks = C.int_tensor(seq_lp.ranks, arg, "FlatLogprobs.ranks", where, none=-1, minimum=None)[idx]
    return pos, ids, lps, ranks


class _Entries:
    """Entries of all sequences: Python lists for dict outputs, tensor chunks for flat ones."""

    def __init__(self):
        self.lists = ([], [], [], [])
        self.chunks = []

    def flush(self):
        pos, ids, lps, ranks = self.lists
        if pos:
            self.chunks.append((torch.tensor(pos, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64),
                                torch.tensor(lps, dtype=torch.float64), torch.tensor(ranks, dtype=torch.int64)))
            self.lists = ([], [], [], [])

    def tensors(self):
        self.flush()
        if not self.chunks:
            e = torch.zeros(0, dtype=torch.int64)
            return e, e, torch.zeros(0, dtype=torch.float64), e
        return tuple(torch.cat(c) for c in zip(*self.chunks))


def _flatten_seq(seq_lp, n_tokens: int, b: int, arg: str, base: int, out: _Entries) -> None:
    if seq_lp is None:
        raise ValueError(f"{arg}: sequence {b} has no log-probs (was SamplingParams.logprobs set?)")
    if _is_flat(seq_lp):
        out.flush()
        out.chunks.append(_flat_seq(seq_lp, n_tokens, b, arg, base))
        return
    C.as_sequence(seq_lp, arg, f"sequence {b}", "a list of per-token dicts {token id: Logprob} or a FlatLogprobs")
    if len(seq_lp) != n_tokens:
        raise ValueError(f"{arg}: sequence {b} has {len(seq_lp)} log-prob positions but {n_tokens} "
                         "completion token ids")
    pos, ids, lps, ranks = out.lists
    for t, d in enumerate(seq_lp):
        if d is None or (isinstance(d, Mapping) and not d):
            raise ValueError(f"{arg}: sequence {b}, token {t} has no log-prob entries")
        if not isinstance(d, Mapping):
            C.fail(arg, f"sequence {b}, token {t}", f"expected a dict {{token id: Logprob}}, got {type(d).__name__}")
        n = len(d)
        pos.extend([base + t] * n)
        for tid, lp in d.items():
            # exact-type fast paths; the checked (slow) path only for anything unusual
            if type(tid) is not int or tid < 0:
                tid = C.token_id(tid, arg, f"sequence {b}, token {t}")
            tl = type(lp)
            if tl is float or tl is int:  # a plain {id: logprob} dict
                value, rank = float(lp), -1
            elif hasattr(lp, "logprob"):
                value, rank = lp.logprob, getattr(lp, "rank", None)
                if type(value) is not float:
                    value = C.logprob(value, arg, f"sequence {b}, token {t}", f"Logprob.logprob of token id {tid}")
                if rank is None:
                    rank = -1
                elif type(rank) is not int:
                    rank = _rank(rank, arg, f"sequence {b}, token {t}")
            elif C.is_real(lp):
                value, rank = float(lp), -1
            else:
                C.fail(arg, f"sequence {b}, token {t}", f"the entry of token id {tid} must be a Logprob or a "
                                                        f"number, got {lp!r} ({type(lp).__name__})")
            ids.append(tid)
            lps.append(value)
            ranks.append(rank)


def _to_tensors(out):
    pos, ids, lps, ranks = out
    return (torch.tensor(pos, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64),
            torch.tensor(lps, dtype=torch.float64), torch.tensor(ranks, dtype=torch.int64))


# ---------------------------------------------------------------- public
def from_vllm_logprobs(
    logprobs: Sequence,
    token_ids: Sequence[Sequence[int]],
    *,
    k: int,
    logprobs_mode: str | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    pad_to: int | None = None,
    pad_id: int = 0,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> Rollout:
    """Per-sequence vLLM sample log-probs -> :class:`pdmask.Rollout`.

    Args:
        logprobs: one entry per sequence: ``CompletionOutput.logprobs``, i.e. a
            ``list[dict[int, Logprob]]`` or a ``FlatLogprobs`` (plain ``{id: float}``
            dicts are accepted too; their entries have no rank).
        token_ids: the sampled token ids of each sequence (``CompletionOutput.token_ids``);
            the sampled token is found by id, never by its place in the dict.
        k: top-K width to return (<= ``SamplingParams.logprobs``); 0 returns no top-K.
        logprobs_mode, temperature, top_p, top_k, min_p: the engine's settings; checked
            by :func:`check_sampling_semantics` (warns on raw mode with temperature != 1).
        pad_to: pad T to this length (default: the longest sequence).
        pad_id: sampled id written at padding positions.
        dtype: float dtype of the log-prob tensors (vLLM computes them in float32).

    Naive equivalent, per position with ``d = logprobs[b][t]``, ``s = token_ids[b][t]``::

        sampled_logprob = d[s].logprob
        topk = sorted(d.items(), key=lambda kv: kv[1].rank)[:k]   # rank 1 first
    """
    check_sampling_semantics(logprobs_mode=logprobs_mode, temperature=temperature, top_p=top_p,
                             top_k=top_k, min_p=min_p, stacklevel=3)
    C.as_sequence(logprobs, "logprobs", "", "one entry per sequence (a list)")
    C.as_sequence(token_ids, "token_ids", "", "one list of token ids per sequence")
    if len(logprobs) != len(token_ids):
        raise ValueError(f"logprobs: {len(logprobs)} sequences but token_ids has {len(token_ids)}")
    out = _Entries()
    base = 0
    sampled = []
    for b, (seq_lp, seq_ids) in enumerate(zip(logprobs, token_ids)):
        seq_ids = C.token_ids(seq_ids, "token_ids", f"sequence {b}")
        _flatten_seq(seq_lp, len(seq_ids), b, "logprobs", base, out)
        sampled.append(seq_ids)
        base += len(seq_ids)
    pos, ids, lps, ranks = out.tensors()
    return assemble(pos, ids, lps, ranks, sampled, k=k, arg="logprobs", pad_to=pad_to, pad_id=pad_id,
                    dtype=dtype, device=device)


def from_vllm_outputs(
    outputs: Sequence,
    *,
    k: int | None = None,
    sampling_params=None,
    logprobs_mode: str | None = None,
    pad_to: int | None = None,
    pad_id: int = 0,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> Rollout:
    """``LLM.generate`` results (``RequestOutput`` s, flattened over their ``.outputs``, or
    ``CompletionOutput`` s) -> :class:`pdmask.Rollout`.

    ``k`` defaults to ``sampling_params.logprobs``. Pass ``logprobs_mode`` (e.g.
    ``logprobs_mode_of(llm)``) and ``sampling_params`` to get the semantics check.
    """
    comps = []
    for i, o in enumerate(C.as_sequence(outputs, "outputs", "", "a list of RequestOutput / CompletionOutput")):
        for c in (o.outputs if hasattr(o, "outputs") else [o]):
            if not (hasattr(c, "logprobs") and hasattr(c, "token_ids")):
                C.fail("outputs", f"item {i}", f"expected a vLLM RequestOutput or CompletionOutput, got "
                                               f"{type(c).__name__}")
            comps.append(c)
    if k is None:
        k = getattr(sampling_params, "logprobs", None)
        if k is None:
            raise ValueError("k: not given and sampling_params.logprobs is unset")
    fields = _sampling_fields(sampling_params) if sampling_params is not None else {}
    return from_vllm_logprobs([c.logprobs for c in comps], [c.token_ids for c in comps], k=k,
                              logprobs_mode=logprobs_mode, pad_to=pad_to, pad_id=pad_id, dtype=dtype,
                              device=device, **{n: fields.get(n) for n in ("temperature", "top_p", "top_k",
                                                                            "min_p")})


def from_ranked_lists(
    logprobs: Sequence[Sequence[Sequence[float | None]]],
    logprob_token_ids: Sequence[Sequence[Sequence[int]]],
    token_ids: Sequence[Sequence[int]],
    *,
    k: int,
    pad_to: int | None = None,
    pad_id: int = 0,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> Rollout:
    """TRL's ``(logprobs, logprob_token_ids)`` lists (B, T, K or K+1, sorted by rank or by
    descending log-prob, the sampled token merged in) -> :class:`pdmask.Rollout`.

    ``None`` log-probs (TRL's stand-in for NaN) are rejected. The lists carry no ranks, so
    entries are ordered by descending log-prob with the sampled token last among equals:
    a sampled token outside the top-K (the (K+1)-th entry) is the one dropped, also when
    it ties with the K-th.
    """
    for name, x in (("logprobs", logprobs), ("logprob_token_ids", logprob_token_ids), ("token_ids", token_ids)):
        C.as_sequence(x, name, "", "one list per sequence")
    if not (len(logprobs) == len(logprob_token_ids) == len(token_ids)):
        raise ValueError(f"logprobs: {len(logprobs)} sequences, logprob_token_ids {len(logprob_token_ids)}, "
                         f"token_ids {len(token_ids)}; they must match")
    pos, ids, lps, ranks = [], [], [], []
    base = 0
    sampled = []
    for b, (lp_seq, id_seq, s_seq) in enumerate(zip(logprobs, logprob_token_ids, token_ids)):
        s_seq = C.token_ids(s_seq, "token_ids", f"sequence {b}")
        C.as_sequence(lp_seq, "logprobs", f"sequence {b}", "a list of per-token lists")
        C.as_sequence(id_seq, "logprob_token_ids", f"sequence {b}", "a list of per-token lists")
        if len(lp_seq) != len(s_seq) or len(id_seq) != len(s_seq):
            raise ValueError(f"logprobs: sequence {b} has {len(lp_seq)} positions (ids: {len(id_seq)}) "
                             f"but {len(s_seq)} completion token ids")
        for t, (lp_row, id_row) in enumerate(zip(lp_seq, id_seq)):
            where = f"sequence {b}, token {t}"
            C.as_sequence(lp_row, "logprobs", where, "a list of log-probs")
            C.as_sequence(id_row, "logprob_token_ids", where, "a list of token ids")
            if len(lp_row) != len(id_row):
                raise ValueError(f"logprob_token_ids: {where} has {len(id_row)} ids "
                                 f"for {len(lp_row)} log-probs")
            n = len(lp_row)
            pos.extend([base + t] * n)
            ids.extend(C.token_id(x, "logprob_token_ids", where) for x in id_row)
            for x in lp_row:
                if x is None:  # TRL's stand-in for NaN
                    C.fail("logprobs", where, "a log-prob is None (TRL writes None for NaN); the engine's "
                                              "log-probs are broken at this position")
                lps.append(C.logprob(x, "logprobs", where))
            ranks.extend([-1] * n)
        sampled.append(s_seq)
        base += len(s_seq)
    p, i, lp, r = _to_tensors((pos, ids, lps, ranks))
    return assemble(p, i, lp, r, sampled, k=k, arg="logprobs", pad_to=pad_to, pad_id=pad_id,
                    dtype=dtype, device=device)
