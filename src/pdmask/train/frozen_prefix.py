"""The frozen prefix, computed once per step (``frozen_prefix_cache``).

With ``train_blocks = N`` the embeddings and the lower ``L - N`` decoder blocks are frozen, so
they map the step's tokens to the same hidden states in the anchor forward (``anchor: old``)
and in every mini-batch's update forward. This module computes them once per step and lets
every forward run the top N blocks only:

- :func:`step_start` — the step's first pass, over the first epoch's mini-batches exactly as
  the updates slice them: with ``anchor: old`` it *is* the anchor's forward
  (:func:`pdmask.train.anchoring.old_anchor`), with a forward pre-hook on block ``L - N``
  recording what enters it; with the rollout anchor the same hook ends the forward there.
  The hidden states go into one (n, S - 1, H) buffer in the batch's own columns
  (:class:`FrozenPrefix`).
- :meth:`FrozenPrefix.rows` — a mini-batch's slice of it (:class:`PrefixRows`), whose
  :meth:`~PrefixRows.forward` is the trainer forward from block ``L - N`` on: the model's
  own forward (its attention mask and rotary tables, made from the mini-batch's attention
  mask as always) with ``inputs_embeds`` = the slice and the frozen blocks passing their
  input through (:func:`skipping`).

Equality. A mini-batch the pass ran on gets the very tensor its own forward would have
computed, so its logits, loss and gradients are bit for bit those without the cache
(``tests/train/test_frozen_prefix.py``). Another slice of the same rows (a later epoch's
mini-batch, ``frozen_prefix_cache: always`` only) reads hidden states computed in a batch of
another shape; positions count real tokens (:func:`pdmask.engine.hf.position_ids`) and
padding is masked, so they are equal up to float rounding, and that is tested too.

Naive torch of one update forward with the cache::

    h = prefix[idx, p0:P + T - 1]                 # what block L - N saw in the step's first pass
    logits = model(inputs_embeds=h, ...) with blocks[:L - N] replaced by the identity
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..engine.base import RolloutBatch
from ..engine.hf import response_hidden, response_logits
from .anchoring import StepAnchor, old_anchor
from .forwards import forward_for
from .trainable import decoder_parts

#: ``frozen_prefix_cache`` values: ``auto`` reuses the prefix where that is bit for bit the plain
#: forward (the anchor forward and the first epoch's updates), ``always`` in every epoch (later
#: epochs to float rounding), ``never``: the whole forward every time.
PREFIX_CACHE = ("auto", "always", "never")
#: Relative tolerance of the once-per-run check that the replay reproduces the model's forward, by
#: dtype (a wrong structure is off by O(1); GPU kernels may differ in the last bits).
CHECK_RTOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-2}


class _Stop(Exception):
    """Ends a forward at the first trained block (its input is all the prefix pass needs)."""


def split_block_call(args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, tuple, dict]:
    """A decoder block's call as ``(hidden state, other positional args, other kwargs)``: the
    hidden state is the first positional argument, or ``hidden_states=`` (transformers' blocks
    are called either way)."""
    if args:
        return args[0], tuple(args[1:]), dict(kwargs)
    return kwargs.get("hidden_states"), (), {k: v for k, v in kwargs.items() if k != "hidden_states"}


def caches_prefix(cfg) -> bool:
    """Whether a step of ``cfg`` caches its frozen prefix: ``train_blocks >= 1`` (something is
    frozen below the trained blocks), ``frozen_prefix_cache`` not ``never``, and a mode whose
    update reads the plain trainer forward (the ``pdm-batch-*`` modes run their own)."""
    return cfg.frozen_prefix_cache != "never" and cfg.train_blocks >= 1 and forward_for(cfg.loss.mode) is None


@contextmanager
def recording(block: torch.nn.Module, out: list, stop: bool):
    """Append the hidden state entering ``block`` (detached) to ``out`` at each forward through it;
    ``stop``: end that forward there (:class:`_Stop`, caught by the caller)."""

    def hook(module, args, kwargs):
        h, _, _ = split_block_call(args, kwargs)
        out.append(h.detach())
        if stop:
            raise _Stop

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield out
    finally:
        handle.remove()


@torch.no_grad()
def prefix_hidden(model, block: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
    """What enters ``block`` in the trainer forward of ``batch`` (B, S - 1, H), no gradient; the
    forward ends there."""
    out: list = []
    with recording(block, out, stop=True):
        try:
            response_logits(model, batch.sequences, batch.attention_mask, batch.prompt_len)
        except _Stop:
            pass
    return out[0]


@contextmanager
def skipping(blocks):
    """The ``blocks`` pass their hidden state through (an instance ``forward`` that returns it),
    restored on exit: the model's own forward then runs from the first block after them."""

    def identity(hidden_states, *args, **kwargs):
        return hidden_states

    try:
        for b in blocks:
            b.forward = identity
        yield
    finally:
        for b in blocks:
            b.__dict__.pop("forward", None)


def _dropout(model) -> str | None:
    """A dropout that is active in ``model`` (training mode), named, or None: with one the frozen
    blocks draw new noise in every forward, so their output is not the same twice."""
    if not model.training:
        return None
    conf = getattr(model, "config", None)
    for k, v in sorted(vars(conf).items()) if conf is not None else ():
        if (k.endswith("dropout") or k.endswith("pdrop")) and isinstance(v, float) and v > 0:
            return f"{k}={v:g}"
    return next((f"{n} (p={m.p:g})" for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0),
                None)


@dataclass
class PrefixRows:
    """A mini-batch's frozen prefix: ``hidden`` (B, W, H), what block ``first`` receives."""

    hidden: torch.Tensor
    first: int

    def forward(self, model, batch: RolloutBatch, hidden: bool = False) -> torch.Tensor:
        """The trainer forward of ``batch`` from block ``first`` on: (B, T, V) logits, or with
        ``hidden`` the (B, T, H) final hidden states (:func:`pdmask.train.update.trainer_forward`)."""
        blocks, _head, _norm = decoder_parts(model)
        fwd = response_hidden if hidden else response_logits
        with skipping(list(blocks)[:self.first]):
            return fwd(model, batch.sequences, batch.attention_mask, batch.prompt_len, inputs_embeds=self.hidden)


@dataclass
class FrozenPrefix:
    """The step's frozen prefix: ``hidden`` (n, S - 1, H) in the batch's columns (zero where no pass
    ran: padding), ``first`` the first trained block, ``exact`` the first epoch's mini-batches (row
    lists) it was computed on, ``every_slice`` whether other slices read it too."""

    hidden: torch.Tensor
    first: int
    exact: set
    every_slice: bool

    def rows(self, idx: list[int], sub: RolloutBatch, prompt_len: int) -> PrefixRows | None:
        """Rows ``idx`` at ``sub``'s columns (``sub = select(batch, idx, ...)``; ``prompt_len`` the
        batch's), or None where this slice is to run the whole forward (``auto``: a slice the pass
        did not run on)."""
        if tuple(idx) not in self.exact and not self.every_slice:
            return None
        p0 = prompt_len - sub.prompt_len  # select's first column
        ix = torch.as_tensor(idx, device=self.hidden.device)
        return PrefixRows(self.hidden[ix, p0:p0 + sub.sequences.shape[1] - 1], self.first)


def step_start(model, batch: RolloutBatch, advantages: torch.Tensor, perm: list[int], mb: int, select, plens, rlens,
               cfg, *, check: bool = False) -> tuple[StepAnchor | None, FrozenPrefix | None]:
    """The step's ``pi_old`` (``anchor: old``, else None) and frozen prefix (None when not cached,
    :func:`caches_prefix`), from one pass over the first epoch's mini-batches of ``perm``
    (``mb`` rows each, cut by ``select`` from the host lengths ``plens`` / ``rlens``).

    ``check`` (the run's first step): refuse a model with active dropout, and check once that the
    replay of mini-batch 1 from its prefix reproduces the model's forward; either failure is one
    line naming ``frozen_prefix_cache``."""
    if not caches_prefix(cfg):
        anchor = old_anchor(model, batch, advantages, perm, mb, select, plens, rlens, cfg) if cfg.loss.anchored else None
        return anchor, None
    blocks, _head, _norm = decoder_parts(model)
    first = len(blocks) - cfg.train_blocks
    if check and (why := _dropout(model)) is not None:
        raise ValueError(f"frozen_prefix_cache: the model has dropout ({why}), so its frozen blocks do not give the "
                         "same hidden states twice; set frozen_prefix_cache=never")
    subs = [(idx, select(batch, idx, plens, rlens)) for idx in _slices(perm, mb)]
    if cfg.loss.anchored:  # the anchor's own forward passes block `first`: the prefix comes with it
        with recording(blocks[first], parts := [], stop=False):
            anchor = old_anchor(model, batch, advantages, perm, mb, select, plens, rlens, cfg)
    else:
        anchor, parts = None, [prefix_hidden(model, blocks[first], sub) for _, sub in subs]
    if len(parts) != len(subs):
        raise RuntimeError(f"frozen_prefix_cache: block {first} ran {len(parts)} times in the step's first pass, "
                           f"expected {len(subs)} (one per mini-batch)")
    prefix = _assemble(batch, subs, parts, first, every_slice=cfg.frozen_prefix_cache == "always")
    if check:
        _check_replay(model, subs[0][1], prefix.rows(subs[0][0], subs[0][1], batch.prompt_len), cfg)
    return anchor, prefix


def _slices(perm: list[int], mb: int) -> list[list[int]]:
    return [perm[j * mb:(j + 1) * mb] for j in range(len(perm) // mb)]


def _assemble(batch: RolloutBatch, subs, parts, first: int, every_slice: bool) -> FrozenPrefix:
    """The (n, S - 1, H) buffer from the pass's per-mini-batch hidden states (each at its columns)."""
    n, S = batch.sequences.shape
    h0 = parts[0]
    buf = torch.zeros(n, S - 1, h0.shape[-1], dtype=h0.dtype, device=h0.device)
    for (idx, sub), h in zip(subs, parts):
        p0 = batch.prompt_len - sub.prompt_len
        buf[torch.as_tensor(idx, device=buf.device), p0:p0 + h.shape[1]] = h
    return FrozenPrefix(buf, first, {tuple(idx) for idx, _ in subs}, every_slice)


def _check_replay(model, sub: RolloutBatch, rows: PrefixRows, cfg) -> None:
    """Mini-batch 1's forward from its cached prefix against the model's whole forward (once per run)."""
    hidden = cfg.loss_from == "hidden"
    whole = response_hidden if hidden else response_logits
    with torch.no_grad():
        ref = whole(model, sub.sequences, sub.attention_mask, sub.prompt_len)
        try:
            got = rows.forward(model, sub, hidden=hidden)
        except Exception as e:  # a decoder whose blocks cannot be passed through this way
            raise ValueError(f"frozen_prefix_cache: {type(model).__name__}'s forward cannot start at block "
                             f"{rows.first} ({type(e).__name__}: {e}); set frozen_prefix_cache=never") from None
    tol = CHECK_RTOL.get(ref.dtype, 1e-4)
    err = (got.float() - ref.float()).abs().max().item() if got.shape == ref.shape else float("inf")
    if not err <= tol * max(ref.float().abs().max().item(), 1.0):
        raise ValueError(f"frozen_prefix_cache: {type(model).__name__}'s forward from block {rows.first} on the "
                         f"cached prefix is not its whole forward (max |diff| {err:.3g}); set frozen_prefix_cache=never")
