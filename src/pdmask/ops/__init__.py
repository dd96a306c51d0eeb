"""Per-token row statistics: every reduction over the vocabulary that the library makes.

This package is the only code of the library that reads the (N, V) logits
(:func:`hidden_row_stats` reads hidden states and the LM-head weight instead).
:func:`row_stats` returns the dict of the reference :func:`._reference.reduce_rows`
(``lse``, ``logp``, ``sum_p2``, ``entropy``; with top-K ids ``topk_logp`` and the
:data:`TAIL_KEYS` of the support's tail; with ``rollout_logits`` also the full-vocabulary
:data:`FULL_KEYS`), with ``logp`` differentiable through an ``autograd.Function`` whose
backward is ``g (e_k - softmax(z / T)) / T``.

Implementations, chosen by ``impl``:

- ``"torch"``: chunked plain torch, one ``exp`` pass per cache-sized chunk (CPU, and the
  fallback anywhere); peak extra memory two chunk buffers.
- ``"triton"``: a Triton kernel, one program per row, a single streaming pass with an
  online log-sum-exp and float32 accumulation (CUDA; or Triton's CPU interpreter when
  ``TRITON_INTERPRET=1``, for tests). Extra memory O(N K).
- ``"reference"``: :func:`._reference.reduce_rows` + :class:`._reference.SampledLogprob`
  (the plain test oracle, :mod:`pdmask.ops._reference`).
- ``"auto"`` (default): ``"triton"`` for CUDA logits in fp16/bf16/fp32 when Triton is
  installed, otherwise ``"torch"``. It never imports Triton for CPU tensors.

Naive torch equivalent::

    logq = torch.log_softmax(logits.float() / T, -1)
    lse = torch.logsumexp(logits.float() / T, -1); logp = logq.gather(1, k[:, None])[:, 0]
    sum_p2 = logq.exp().pow(2).sum(-1); entropy = -(logq.exp() * logq).sum(-1)
    topk_logp = logq.gather(1, topk_ids)
    tail = ones.scatter(1, cat([topk_ids, k[:, None]], 1), False)     # outside S' = topK ∪ {k}
    lse_tail = torch.logsumexp((logits.float() / T).masked_fill(~tail, -inf), -1)
    sum_p2_tail = (logq.exp().pow(2) * tail).sum(-1)
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import lru_cache

import torch

from .._validate import check_choice, check_chunk_size, check_positive
from . import _reference, _torch
from ._autograd import KEYS, FusedRowStats, as_dict
from ._device import check_device
from ._reference import FULL_KEYS, TAIL_KEYS, chunk_rows_for, compute_dtype
from ._truncate import TRUNC_KEYS, Sampling

IMPLS = ("auto", "torch", "triton", "reference")

__all__ = ["FULL_KEYS", "IMPLS", "KEYS", "TAIL_KEYS", "TRUNC_KEYS", "Compute", "FusedRowStats", "Sampling",
           "check_impl", "check_hidden", "check_kept_mask", "check_truncation", "chunk_rows_for", "sampling_kept_mask", "compute_dtype",
           "hidden_row_stats", "resolve_impl", "row_stats", "triton_available"]


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether the optional ``triton`` package is installed (not imported here)."""
    return importlib.util.find_spec("triton") is not None


def check_impl(impl: str) -> None:
    """``impl`` is one of :data:`IMPLS` (a ValueError naming it otherwise)."""
    check_choice("impl", impl, IMPLS)


@dataclass(frozen=True)
class Compute:
    """How the vocabulary reductions run (no effect on the numbers beyond rounding).

    ``impl``: one of :data:`IMPLS` (see :func:`row_stats`); ``chunk_rows``: rows per chunk
    (None: each implementation's default); ``chunk_cols``: vocabulary columns per chunk of
    :func:`hidden_row_stats` (None: 4 M logits). Checked here, once.
    """

    impl: str = "auto"
    chunk_rows: int | None = None
    chunk_cols: int | None = None

    def __post_init__(self) -> None:
        check_impl(self.impl)
        check_chunk_size("chunk_rows", self.chunk_rows)
        check_chunk_size("chunk_cols", self.chunk_cols, "vocabulary columns per chunk")


def check_truncation(impl: str, truncation: Sampling | None, kept_mask, rollout_logits, *,
                     rollout: bool = False) -> Sampling | None:
    """The rules of truncated sampling, in one place: not both a kept set and the
    truncation parameters, no full-vocabulary terms (``rollout_logits``), no Triton.
    Returns the truncation in force (``truncation`` if it truncates, else None). Errors
    name ``rollout.kept_mask`` / ``rollout.logits`` when the tensors came in a
    :class:`pdmask.Rollout` (``rollout=True``)."""
    kept_name, logits_name = ("rollout.kept_mask", "rollout.logits") if rollout else ("kept_mask", "rollout_logits")
    trunc = truncation if truncation is not None and truncation.truncated else None
    if kept_mask is not None and trunc is not None:
        raise ValueError(f"{kept_name}: give either the engine's kept set or the truncation parameters "
                         "(top_k / top_p / min_p), not both")
    truncated = trunc is not None or kept_mask is not None
    if truncated and rollout_logits is not None:
        raise ValueError(f"{logits_name}: the full-vocabulary terms are not available with truncated sampling")
    if truncated and impl == "triton":
        raise ValueError("impl: 'triton' has no kernel for truncated sampling; use impl='torch' or 'auto'")
    return trunc


def resolve_impl(impl: str, logits: torch.Tensor, truncated: bool = False) -> str:
    """The implementation ``impl`` stands for on these logits (``"auto"`` resolved;
    truncated sampling runs on the torch path)."""
    check_impl(impl)
    if impl != "auto":
        return impl
    if truncated:
        return "torch"
    if logits.is_cuda and logits.dtype in (torch.float16, torch.bfloat16, torch.float32) and triton_available():
        return "triton"
    return "torch"


def _backend(name: str, logits: torch.Tensor):
    if name == "torch":
        return _torch
    if not triton_available():
        where = "" if logits.is_cuda else " and CUDA logits (on CPU use impl='torch' or 'auto')"
        raise ValueError(f"impl: 'triton' needs the optional triton package (pip install -e '.[triton]' from a pdmask checkout){where}")
    check_device(logits)  # before importing triton: CPU tensors need the interpreter
    from . import _kernel  # lazy: imports triton

    return _kernel


def _check(logits, sampled_ids, topk_ids, temperature, chunk_rows, values: bool, rollout_logits=None) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() != 2:
        raise ValueError("logits: expected a floating-point (N, V) tensor, got "
                         f"{getattr(logits, 'dtype', type(logits).__name__)} {tuple(getattr(logits, 'shape', ()))}")
    N, V = logits.shape
    if V < 1:
        raise ValueError("logits: the vocabulary dimension is empty")
    for name, t, shape in (("sampled_ids", sampled_ids, (N,)), ("topk_ids", topk_ids, None)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.dtype == torch.bool:
            raise ValueError(f"{name}: expected an integer tensor of token ids")
        if shape is None and (t.dim() != 2 or t.shape[0] != N or t.shape[1] < 1):
            raise ValueError(f"{name}: expected shape ({N}, K) with K >= 1, got {tuple(t.shape)}")
        if shape is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
        if values and t.numel() and bool(((t < 0) | (t >= V)).any()):
            raise ValueError(f"{name}: ids must lie in [0, {V})")
    if rollout_logits is not None and (not isinstance(rollout_logits, torch.Tensor)
                                       or not rollout_logits.is_floating_point()
                                       or tuple(rollout_logits.shape) != (N, V)):
        raise ValueError(f"rollout_logits: expected a floating-point ({N}, {V}) tensor like logits, got "
                         f"{getattr(rollout_logits, 'dtype', type(rollout_logits).__name__)} "
                         f"{tuple(getattr(rollout_logits, 'shape', ()))}")
    check_positive("temperature", temperature)
    check_chunk_size("chunk_rows", chunk_rows)


def check_kept_mask(kept_mask, shape: tuple, name: str = "kept_mask") -> None:
    """``kept_mask`` is None or a bool tensor of ``shape`` (the engine's kept set)."""
    if kept_mask is None:
        return
    if not isinstance(kept_mask, torch.Tensor) or kept_mask.dtype != torch.bool:
        raise ValueError(f"{name}: expected a bool tensor (the engine's kept set), got "
                         f"{getattr(kept_mask, 'dtype', type(kept_mask).__name__)}")
    if tuple(kept_mask.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(kept_mask.shape)}")


def sampling_kept_mask(scaled_logits: torch.Tensor, *, top_k: int | None = None, top_p: float | None = None,
                       min_p: float | None = None) -> torch.Tensor:
    """(N, V) bool: the tokens top-k / top-p / min-p sampling keeps from temperature-scaled
    logits, in vLLM's order (min-p, top-k, top-p; :mod:`pdmask.ops._truncate`). All True
    when every rule is off. For engines that sample, and tests."""
    from ._truncate import rule_threshold

    s = Sampling(top_k=top_k, top_p=top_p, min_p=min_p)
    if not s.truncated:
        return torch.ones(scaled_logits.shape, dtype=torch.bool, device=scaled_logits.device)
    return scaled_logits >= rule_threshold(scaled_logits, s)[:, None]


def row_stats(
    logits: torch.Tensor,  # (N, V)
    sampled_ids: torch.Tensor,  # (N,)
    topk_ids: torch.Tensor | None = None,  # (N, K)
    *,
    temperature: float = 1.0,
    chunk_rows: int | None = None,
    impl: str = "auto",
    validate: bool = True,
    rollout_logits: torch.Tensor | None = None,  # (N, V)
    truncation: Sampling | None = None,
    kept_mask: torch.Tensor | None = None,  # (N, V) bool
) -> dict[str, torch.Tensor]:
    """Row statistics of ``pi = softmax(logits / temperature)``.

    Args:
        logits: (N, V) float16/bfloat16/float32/float64 (reduced in float32, float64 kept).
        sampled_ids: (N,) the sampled token per row.
        topk_ids: (N, K) ids whose log-probs to return (the rollout's top-K), or None.
        chunk_rows: rows per chunk (``"torch"``/``"reference"``; default: a cache-sized
            chunk for ``"torch"``, 16 M elements for ``"reference"``). Ignored by Triton.
        impl: ``"auto"``, ``"torch"``, ``"triton"`` or ``"reference"`` (module docstring).
        validate: check shapes and id ranges (one host sync). Out-of-range ids give NaN
            from the Triton kernel instead of an out-of-bounds read.
        rollout_logits: (N, V) the rollout policy's full logits, same temperature
            (simulation / oracle only), or None. Adds the :data:`FULL_KEYS`, in the same
            pass over the logits for ``"torch"`` and ``"reference"``; ``"triton"`` takes
            them from the reference (a second read of the logits).

    Returns ``lse`` (N,), ``logp`` (N,) = log pi_k (carries the gradient when ``logits``
    requires it), ``sum_p2`` (N,) = sum pi^2, ``entropy`` (N,) = -sum pi log pi, and with
    ``topk_ids`` ``topk_logp`` (N, K) = log pi at topk_ids and the tail of the support
    ``S' = topK ∪ {k}``: ``lse_tail`` (N,), the log-sum-exp of ``logits / T`` over the ids
    outside S' (``log pi_T = lse_tail - lse``, summed over the tail itself, so it stays
    accurate in float32 however small pi_T is; ``-inf`` for an empty tail) and
    ``sum_p2_tail`` (N,) = sum of pi^2 there; float32 (float64 for float64
    logits; ``"triton"`` always float32). With ``rollout_logits`` also (detached)
    ``full_kl``, ``full_tv``, ``full_mu_k`` = mu_k, ``sum_p_mu`` = sum pi mu,
    ``sum_p_s`` = sum pi s and ``sum_p2_s`` = sum pi^2 s with ``s = 1/2 sign(pi - mu)``.

    Truncated sampling: ``truncation`` (a :class:`Sampling` whose ``top_k``, ``top_p``,
    ``min_p`` are the engine's truncation, vLLM's order, :mod:`pdmask.ops._truncate`;
    its temperature is not read here, ``temperature`` is) makes
    every statistic that of ``pi`` renormalised over the kept set rebuilt on these logits
    (plus the sampled token), and add :data:`TRUNC_KEYS`; ``kept_mask`` (N, V) bool gives
    the engine's own kept set instead. It runs on ``"torch"`` (``"auto"``) or
    ``"reference"``; ``"triton"`` refuses it, and so does ``rollout_logits``.
    """
    _check(logits, sampled_ids, topk_ids, temperature, chunk_rows, values=validate, rollout_logits=rollout_logits)
    check_impl(impl)
    check_kept_mask(kept_mask, tuple(logits.shape))
    sampling = check_truncation(impl, truncation, kept_mask, rollout_logits)
    truncated = sampling is not None or kept_mask is not None
    name = resolve_impl(impl, logits, truncated)
    ids = sampled_ids.long()
    tk = None if topk_ids is None else topk_ids.long()
    if truncated:
        return _truncated(name, logits, ids, tk, temperature, chunk_rows, sampling, kept_mask)
    if name == "reference":
        return _reference.row_stats(logits, ids, tk, temperature=temperature, chunk_rows=chunk_rows,
                                    rollout_logits=rollout_logits)
    backend = _backend(name, logits)
    fused_full = rollout_logits if getattr(backend, "FUSES_FULL", False) else None
    if logits.requires_grad and torch.is_grad_enabled():
        full: dict[str, torch.Tensor] = {}
        res = FusedRowStats.apply(logits, ids, tk, float(temperature), chunk_rows, backend, fused_full, full)
        out = as_dict(res, tk is not None)
        out.update(full)
    else:
        kw = {"chunk_rows": chunk_rows} if getattr(backend, "CHUNKED", False) else {}
        if fused_full is not None:
            kw["rollout_logits"] = fused_full
        out = backend.forward(logits.detach(), ids, tk, temperature=float(temperature), **kw)
    if rollout_logits is not None and fused_full is None:
        # this backend has no full-vocabulary pass: the reference reads the logits again
        out.update(_reference.full_rows(logits.detach(), ids, rollout_logits, temperature=temperature,
                                        chunk_rows=chunk_rows))
    return out


def _truncated(name, logits, ids, tk, temperature, chunk_rows, sampling, kept_mask):
    if name == "reference":
        s = sampling or Sampling()
        return _reference.truncated_row_stats(logits, ids, tk, temperature=temperature, kept_mask=kept_mask,
                                              top_k=s.top_k, top_p=s.top_p, min_p=s.min_p)
    from . import _truncate

    return _truncate.row_stats(logits, ids, tk, temperature=temperature, chunk_rows=chunk_rows, sampling=sampling,
                               kept_mask=kept_mask)


def check_hidden(hidden, weight, *, weight_name: str = "weight", flat: bool = True) -> None:
    """Hidden states (``(N, H)``; any leading shape unless ``flat``) and an LM-head weight
    ``(V, H)`` of the same dtype and device: the one check of the pair."""
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 2 \
            or (flat and hidden.dim() != 2):
        want = "(N, H)" if flat else "(B, T, H) or (N, H)"
        raise ValueError(f"hidden: expected a floating-point {want} tensor, got "
                         f"{getattr(hidden, 'dtype', type(hidden).__name__)} {tuple(getattr(hidden, 'shape', ()))}")
    H = hidden.shape[-1]
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2 \
            or weight.shape[1] != H or weight.shape[0] < 1:
        raise ValueError(f"{weight_name}: expected a floating-point (V, {H}) tensor (H of hidden), got "
                         f"{getattr(weight, 'dtype', type(weight).__name__)} {tuple(getattr(weight, 'shape', ()))}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"{weight_name}: must have the dtype and device of hidden ({hidden.dtype}, "
                         f"{hidden.device}), got {weight.dtype}, {weight.device}")


def hidden_row_stats(
    hidden: torch.Tensor,  # (N, H)
    weight: torch.Tensor,  # (V, H)
    sampled_ids: torch.Tensor,  # (N,)
    topk_ids: torch.Tensor | None = None,  # (N, K)
    *,
    temperature: float = 1.0,
    chunk_cols: int | None = None,
    validate: bool = True,
    truncation: Sampling | None = None,
    kept_mask: torch.Tensor | None = None,  # (N, V) bool
    chunk_rows: int | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`row_stats` of ``logits = hidden @ weight.T`` without materialising the logits.

    The vocabulary is walked in chunks of ``chunk_cols`` columns (default: 4 M logits per
    chunk), Cut-Cross-Entropy style (see :mod:`pdmask.ops._hidden`); ``logp`` is
    differentiable in ``hidden`` and ``weight``. Plain torch only (no Triton kernel yet);
    no LM-head bias and no logit soft-capping. Same keys and dtypes as :func:`row_stats`.

    Truncated sampling (``truncation``, ``kept_mask``: as in :func:`row_stats`) walks the
    rows instead, ``chunk_rows`` at a time (default: 4 M logits per chunk), because top-p
    needs each row whole; its weight gradient is accumulated in float32 (one extra (V, H)
    float32 buffer for bf16/fp16 weights).

    Naive equivalent: ``row_stats(hidden @ weight.T, sampled_ids, topk_ids, ...)``.
    """
    from . import _hidden

    check_hidden(hidden, weight)
    N, V = hidden.shape[0], weight.shape[0]
    # shape / dtype / temperature checks of row_stats on a storage-less (N, V) stand-in
    _check(torch.empty(N, V, device="meta"), sampled_ids, topk_ids, temperature, None, values=False)
    if validate:
        for name, t in (("sampled_ids", sampled_ids), ("topk_ids", topk_ids)):
            if t is not None and t.numel() and bool(((t < 0) | (t >= V)).any()):
                raise ValueError(f"{name}: ids must lie in [0, {V})")
    check_chunk_size("chunk_cols", chunk_cols, "vocabulary columns per chunk")
    check_chunk_size("chunk_rows", chunk_rows)
    check_kept_mask(kept_mask, (N, V))
    sampling = check_truncation("torch", truncation, kept_mask, None)
    ids = sampled_ids.long()
    tk = None if topk_ids is None else topk_ids.long()
    grad = (hidden.requires_grad or weight.requires_grad) and torch.is_grad_enabled()
    if sampling is not None or kept_mask is not None:
        if grad:
            from ._truncate import ALL_KEYS

            res = _hidden.HiddenTruncRowStats.apply(hidden, weight, ids, tk, float(temperature), chunk_rows,
                                                    sampling, kept_mask)
            return as_dict(res, tk is not None, ALL_KEYS)
        return _hidden.trunc_forward(hidden.detach(), weight.detach(), ids, tk, temperature=float(temperature),
                                     chunk_rows=chunk_rows, sampling=sampling, kept_mask=kept_mask)[0]
    if grad:
        res = _hidden.HiddenRowStats.apply(hidden, weight, ids, tk, float(temperature), chunk_cols)
        return as_dict(res, tk is not None)
    return _hidden.forward(hidden.detach(), weight.detach(), ids, tk, temperature=float(temperature),
                           chunk_cols=chunk_cols)
