"""Padded top-K tensors from a rollout engine's per-token log-prob entries.

Every engine format (vLLM dicts, vLLM ``FlatLogprobs``, TRL's rank-sorted lists, SGLang
``meta_info``) is first flattened to one list of *entries* ``(position, token id,
log-prob, rank)``; :func:`assemble` then turns the entries into the :class:`pdmask.Rollout` the core
library takes (padding positions, ``response_mask`` False, hold ``pad_id`` / log-prob 0
/ top-K ids ``0..K-1`` with log-prob ``-inf``; the core ignores them). Keeping a single assembler means the one rule that matters is written
once:

    The engine reports, at each position, the top-K tokens of its sampling distribution
    **plus the sampled token** (K entries when the sampled token is in the top-K, K + 1
    when it is not). The sampled token is identified by its *id* (the completion's
    token ids), never by its place in the list: rank 1 is the most likely token, not
    the sampled one.

Rules of :func:`assemble`, per position:

1. Entries with the same id are merged, keeping the smallest rank (vLLM's
   ``FlatLogprobs`` stores the sampled token twice when it is in the top-K: once
   first with its own rank, once at its top-K place; SGLang's sampled token is merged
   with its top-K entry the same way). Their log-probs must agree within the core's
   rounding tolerance (``|a - b| <= MATCH_ATOL + MATCH_RTOL |b|``, see
   :mod:`pdmask._validate`; ``-inf`` matches only ``-inf``); the kept entry's value is used. Duplicates with different
   log-probs are an error naming the position: there is no right one to pick.
2. The sampled token's log-prob is read from its own entry; a position without one is
   an error (the engine always reports it, so its absence means misaligned inputs).
3. The entries are ordered by rank (or, where a rank is missing, by descending log-prob
   with the sampled token last among equals) and the first ``k`` form the top-K. A
   sampled token outside the top-K has rank > K (vLLM's rank counts the tokens with a
   log-prob >= its own), so it is the one dropped when K + 1 entries are present. It is
   not lost: the core library's top-K support is ``S' = top-K ∪ {sampled}``.
4. Fewer than ``k`` distinct entries is an error, never padded with invented ids:
   claiming ``mu_i = 0`` for a token the engine did not report would change the top-K
   divergence (it moves pi_i out of the tail bucket).

``-inf`` log-probs are kept: with ``processed_logprobs`` and top-k/top-p sampling the
tokens the engine truncated really have ``mu_i = 0`` (see ``docs/engine_formats.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Engine log-probs above LOGPROB_TOL are not log-probs (raw logits, or a wrong mode); the
# same tolerance as the core's checks of the loss inputs.
from .._validate import LOGPROB_TOL, MATCH_ATOL, MATCH_RTOL
from ..rollout import Rollout

#: Stand-in for an unknown rank: sorts after every real rank.
_NO_RANK = 1 << 62


def check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k: must be a non-negative int (the number of top log-probs per token), got {k!r}")
    return k


@dataclass(frozen=True)
class _Layout:
    """Where each of the N flat positions lives in the padded (B, T) output."""

    B: int
    T: int
    seq_of: torch.Tensor  # (N,) int64: sequence of each position
    tok_of: torch.Tensor  # (N,) int64: token index within its sequence
    sampled: torch.Tensor  # (N,) int64: the completion's token id at each position

    @property
    def N(self) -> int:
        return self.sampled.numel()

    def where(self, n: int) -> str:
        return f"sequence {int(self.seq_of[n])}, token {int(self.tok_of[n])}"

    def scatter(self, flat, out: torch.Tensor) -> torch.Tensor:
        """``out[b, t] = flat[n]`` for every position n; ``out`` keeps its fill elsewhere."""
        out[self.seq_of, self.tok_of] = flat
        return out


def _layout(sampled_ids: list[list[int]], pad_to: int | None) -> _Layout:
    lens = [len(s) for s in sampled_ids]
    B = len(lens)
    T = max(lens, default=0)
    if pad_to is not None:
        if not isinstance(pad_to, int) or pad_to < T:
            raise ValueError(f"pad_to: must be an int >= the longest response ({T}), got {pad_to!r}")
        T = pad_to
    N = sum(lens)
    lens_t = torch.tensor(lens, dtype=torch.int64)
    seq_of = torch.repeat_interleave(torch.arange(B), lens_t)  # (N,)
    starts = torch.cumsum(lens_t, 0) - lens_t
    tok_of = torch.arange(N) - starts[seq_of] if N else torch.zeros(0, dtype=torch.int64)
    flat_sampled = torch.tensor([t for s in sampled_ids for t in s], dtype=torch.int64)
    return _Layout(B, T, seq_of, tok_of, flat_sampled)


def _check_entries(pos, ids, logprobs, lay: _Layout, arg: str) -> None:
    """Entries that no engine reports: outside the responses, NaN, positive (logits), negative ids."""
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= lay.N):
        raise ValueError(f"{arg}: entries refer to positions outside the responses")
    nan = torch.isnan(logprobs)
    if bool(nan.any()):
        n = int(pos[nan.nonzero()[0, 0]])
        raise ValueError(f"{arg}: NaN log-prob at {lay.where(n)}")
    bad = logprobs > LOGPROB_TOL
    if bool(bad.any()):
        n = int(pos[bad.nonzero()[0, 0]])
        raise ValueError(
            f"{arg}: positive log-prob {float(logprobs[bad][0]):.4g} at {lay.where(n)}; "
            "these look like logits, not log-probs (vLLM logprobs_mode='raw_logits'/'processed_logits'?)")
    neg = ids < 0
    if bool(neg.any()):
        i = int(neg.nonzero()[0, 0])
        raise ValueError(f"{arg}: negative token id {int(ids[i])} at {lay.where(int(pos[i]))}")


def _merge_duplicates(pos, ids, logprobs, ranks, lay: _Layout, arg: str):
    """Rule 1: one entry per (position, id), the one with the smallest rank; duplicates
    must carry the same log-prob (within rounding).

    Returns the kept ``pos, ids, logprobs, ranks`` and their sort key ``rank_key`` (the
    rank, or :data:`_NO_RANK` where unknown)."""
    rank_key = torch.where(ranks > 0, ranks, torch.full_like(ranks, _NO_RANK))
    o = torch.sort(rank_key, stable=True).indices
    span = int(ids.max()) + 1 if ids.numel() else 1
    key = pos[o] * span + ids[o]
    o = o[torch.sort(key, stable=True).indices]
    key = pos[o] * span + ids[o]
    first = torch.ones_like(key, dtype=torch.bool)
    first[1:] = key[1:] != key[:-1]
    if not bool(first.all()):
        lp = logprobs[o]
        head = torch.cumsum(first.long(), 0) - 1  # group of each sorted entry
        kept = lp[first][head]  # the group's kept value, per entry
        # the relative tolerance only between finite values: with kept = -inf it is inf and
        # would accept any duplicate (a -inf and a finite log-prob are never one number)
        close = (lp - kept).abs() <= MATCH_ATOL + MATCH_RTOL * kept.abs()
        same = (lp == kept) | (close & torch.isfinite(kept) & torch.isfinite(lp))
        if not bool(same.all()):
            j = int((~same).nonzero()[0, 0])
            raise ValueError(
                f"{arg}: token id {int(ids[o][j])} appears twice at {lay.where(int(pos[o][j]))} with different "
                f"log-probs ({float(kept[j]):.6g} and {float(lp[j]):.6g}); the engine reports one value per token "
                "(misaligned or mixed outputs?)")
    o = o[first]
    return pos[o], ids[o], logprobs[o], ranks[o], rank_key[o]


def _sampled_logprob(pos, ids, logprobs, lay: _Layout, arg: str):
    """Rule 2: the sampled token's log-prob, read from its own entry (found by id).

    Returns ``is_s`` (E,) bool, the entries of the sampled tokens, and ``s_lp`` (N,) float64."""
    N = lay.N
    is_s = ids == lay.sampled[pos]
    n_s = torch.zeros(N, dtype=torch.int64).index_add_(0, pos, is_s.long())
    if N and bool((n_s == 0).any()):
        n = int((n_s == 0).nonzero()[0, 0])
        raise ValueError(
            f"{arg}: no entry for the sampled token id {int(lay.sampled[n])} at {lay.where(n)} "
            "(the engine always reports the sampled token; are the log-probs aligned with the completion ids?)")
    s_lp = torch.zeros(N, dtype=torch.float64).index_put_((pos[is_s],), logprobs[is_s])
    if N and bool(torch.isinf(s_lp).any()):
        n = int(torch.isinf(s_lp).nonzero()[0, 0])
        raise ValueError(f"{arg}: the sampled token has log-prob -inf at {lay.where(n)} "
                         "(a sampled token has mu > 0; misaligned inputs?)")
    return is_s, s_lp


def _first_k(pos, ids, logprobs, ranks, rank_key, is_s, lay: _Layout, *, k: int, arg: str):
    """Rules 3 and 4: per position, the entries by rank (by descending log-prob where a rank
    is missing, the sampled token last among equals); the first ``k`` of at least ``k``.

    Returns ``ids (N, k)`` int64 and ``logprobs (N, k)`` float64."""
    N = lay.N
    unknown = torch.zeros(N, dtype=torch.bool).index_put_((pos[ranks <= 0],), torch.tensor(True))
    by_lp = unknown[pos]
    prim = torch.where(by_lp, torch.zeros_like(rank_key), rank_key)
    sec = torch.where(by_lp, -logprobs, torch.zeros_like(logprobs))
    # one lexicographic sort (position, primary, secondary, sampled last) as stable passes
    o = torch.sort(is_s.long(), stable=True).indices
    o = o[torch.sort(sec[o], stable=True).indices]
    o = o[torch.sort(prim[o], stable=True).indices]
    o = o[torch.sort(pos[o], stable=True).indices]
    p_o = pos[o]
    count = torch.zeros(N, dtype=torch.int64).index_add_(0, p_o, torch.ones_like(p_o))
    if N and bool((count < k).any()):
        n = int((count < k).nonzero()[0, 0])
        raise ValueError(
            f"{arg}: only {int(count[n])} distinct entries at {lay.where(n)}, fewer than k={k}; "
            "k must not exceed the number of log-probs the engine was asked for (SamplingParams.logprobs)")
    first_of = torch.cumsum(count, 0) - count
    slot = torch.arange(p_o.numel()) - first_of[p_o]
    take = slot < k
    flat_ids = torch.empty(N, k, dtype=torch.int64)
    flat_lp = torch.empty(N, k, dtype=torch.float64)
    flat_ids[p_o[take], slot[take]] = ids[o][take]
    flat_lp[p_o[take], slot[take]] = logprobs[o][take]
    return flat_ids, flat_lp


def assemble(
    pos: torch.Tensor,  # (E,) int64: flat position of each entry, in [0, N)
    ids: torch.Tensor,  # (E,) int64
    logprobs: torch.Tensor,  # (E,) float64
    ranks: torch.Tensor,  # (E,) int64, -1 where unknown
    sampled_ids: list[list[int]],  # B lists, one id per position
    *,
    k: int,
    arg: str,
    pad_to: int | None = None,
    pad_id: int = 0,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> Rollout:
    """Build a :class:`pdmask.Rollout` from flattened entries (see the module docstring).

    ``arg`` names the user-facing argument the entries came from, for error messages.
    Positions are numbered sequence by sequence: sequence b's token t is
    ``sum(len(s) for s in sampled_ids[:b]) + t``.
    """
    k = check_k(k)
    lay = _layout(sampled_ids, pad_to)
    B, T = lay.B, lay.T
    _check_entries(pos, ids, logprobs, lay, arg)
    pos, ids, logprobs, ranks, rank_key = _merge_duplicates(pos, ids, logprobs, ranks, lay, arg)
    is_s, s_lp = _sampled_logprob(pos, ids, logprobs, lay, arg)  # (E,), (N,)

    topk_ids = topk_lp = None
    if k > 0:
        flat_ids, flat_lp = _first_k(pos, ids, logprobs, ranks, rank_key, is_s, lay, k=k, arg=arg)  # (N, k)
        topk_ids = lay.scatter(flat_ids, torch.arange(k, dtype=torch.int64).repeat(B, T, 1))  # (B, T, k)
        topk_lp = lay.scatter(flat_lp.to(dtype), torch.full((B, T, k), float("-inf"), dtype=dtype))

    out = Rollout(
        sampled_ids=lay.scatter(lay.sampled, torch.full((B, T), pad_id, dtype=torch.int64)),
        sampled_logprob=lay.scatter(s_lp.to(dtype), torch.zeros((B, T), dtype=dtype)),
        topk_ids=topk_ids,
        topk_logprobs=topk_lp,
        response_mask=lay.scatter(True, torch.zeros((B, T), dtype=torch.bool)),
    )
    return out.to(device) if device is not None else out
