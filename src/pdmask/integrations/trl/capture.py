"""Top-K capture on the plain ``transformers`` ``generate`` path.

``generate`` returns no log-probs. A logits processor passed to it sees, at every
decoding step, the float32 next-token scores *after* the built-in processors
(repetition penalty, suppressed tokens, ...) and *before* the sampling warpers
(temperature, top-k, top-p, min-p), which transformers appends after the user's
processors (``GenerationMixin._get_logits_processor``). :class:`TopKRecorder` therefore
applies the same warpers itself, built from the same ``GenerationConfig`` and in the
same order, so what it records is exactly the distribution the token is then sampled
from -- vLLM's ``processed_logprobs``:

    mu = softmax(warp(scores / T))   (tokens cut by top-k / top-p / min-p: -inf,
                                      the kept mass renormalised to 1)

It records per step the top-K ids/log-probs of ``log mu`` and, one step later (when the
sampled token appears as the last input id), the sampled token's log-prob; the last
step's sampled token is read from the completion ids in :meth:`finish`. Memory: one
(B, V) float32 buffer plus (B, K) per step. The scores are returned unchanged.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor
from transformers.generation.logits_process import (
    MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

from ...rollout import Rollout

_UNSUPPORTED = ("top_h", "typical_p", "epsilon_cutoff", "eta_cutoff")


def warpers_for(generation_config) -> list:
    """The sampling warpers ``generate`` applies for ``generation_config`` (same order)."""
    gc = generation_config
    if not gc.do_sample:
        raise ValueError("generation_config: do_sample must be True (greedy decoding has no sampling distribution)")
    for name in _UNSUPPORTED:
        v = getattr(gc, name, None)
        if v is not None and not (name == "typical_p" and v >= 1.0) and not (name.endswith("cutoff") and v == 0.0):
            raise ValueError(f"generation_config: {name}={v!r} is not supported by the top-K capture")
    if getattr(gc, "num_beams", 1) not in (None, 1):
        raise ValueError("generation_config: num_beams must be 1 (beam search is not sampling)")
    w = []
    if gc.temperature is not None and gc.temperature != 1.0:
        w.append(TemperatureLogitsWarper(gc.temperature))
    if gc.top_k is not None and gc.top_k != 0:
        w.append(TopKLogitsWarper(top_k=gc.top_k, min_tokens_to_keep=1))
    if gc.top_p is not None and gc.top_p < 1.0:
        w.append(TopPLogitsWarper(top_p=gc.top_p, min_tokens_to_keep=1))
    if gc.min_p is not None:
        w.append(MinPLogitsWarper(min_p=gc.min_p, min_tokens_to_keep=1))
    return w


class TopKRecorder(LogitsProcessor):
    """Records the sampling distribution's top-K and the sampled token's log-prob.

    Use once per ``generate`` call: ``rec = TopKRecorder(k, generation_config)``,
    ``model.generate(..., generation_config=gc, logits_processor=[rec])``, then
    ``rec.finish(completion_ids)``.
    """

    def __init__(self, k: int, generation_config):
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"k: must be a non-negative int, got {k!r}")
        self.k = k
        self.warpers = warpers_for(generation_config)
        self._topk_ids: list[torch.Tensor] = []  # per step (B, K)
        self._topk_lp: list[torch.Tensor] = []
        self._sampled_lp: list[torch.Tensor] = []  # per step (B,), filled one step late
        self._sampled_id: list[torch.Tensor] = []
        self._prev: torch.Tensor | None = None  # (B, V) log mu of the previous step

    @torch.no_grad()
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._prev is not None:
            last = input_ids[:, -1]
            self._sampled_id.append(last.clone())
            self._sampled_lp.append(self._prev.gather(1, last[:, None]).squeeze(1))
        z = scores.float()
        for w in self.warpers:
            z = w(input_ids, z)
        logq = torch.log_softmax(z, dim=-1)  # (B, V) log mu
        if self.k:
            if self.k > logq.shape[-1]:
                raise ValueError(f"k: {self.k} exceeds the vocabulary size {logq.shape[-1]}")
            v, i = logq.topk(self.k, dim=-1)
            self._topk_ids.append(i)
            self._topk_lp.append(v)
        self._prev = logq
        return scores

    @property
    def num_steps(self) -> int:
        return len(self._sampled_lp) + (self._prev is not None)

    def finish(self, completion_ids: list[list[int]], *, device=None) -> Rollout:
        """Align the records with the completions (lists cut at EOS, one per row).

        Raises ``RuntimeError`` if a recorded sampled token differs from the completion
        (the recorder was attached to another ``generate`` call).
        """
        S = self.num_steps
        B = len(completion_ids)
        lens = [len(c) for c in completion_ids]
        if S == 0 or (self._prev is not None and self._prev.shape[0] != B):
            raise RuntimeError(f"TopKRecorder: recorded {S} steps for a batch of "
                               f"{None if self._prev is None else self._prev.shape[0]} rows, got {B} completions")
        if max(lens, default=0) > S:
            raise RuntimeError(f"TopKRecorder: a completion has {max(lens)} tokens but only {S} steps were recorded")
        dev = self._prev.device
        last_ids = torch.tensor([c[S - 1] if len(c) == S else 0 for c in completion_ids], device=dev)
        s_lp = torch.stack(self._sampled_lp + [self._prev.gather(1, last_ids[:, None]).squeeze(1)], 1)  # (B, S)
        s_id = torch.stack(self._sampled_id + [last_ids], 1)  # (B, S)
        mask = torch.arange(S, device=dev)[None, :] < torch.tensor(lens, device=dev)[:, None]
        ids = torch.zeros(B, S, dtype=torch.long, device=dev)
        for b, c in enumerate(completion_ids):
            ids[b, : len(c)] = torch.tensor(c, dtype=torch.long, device=dev)
        if bool(((s_id != ids) & mask).any()):
            raise RuntimeError("TopKRecorder: recorded sampled tokens differ from the completion ids")
        s_lp = torch.where(mask, s_lp, torch.zeros_like(s_lp))
        tk_ids = tk_lp = None
        if self.k:
            tk_ids = torch.stack(self._topk_ids, 1)  # (B, S, K)
            tk_lp = torch.stack(self._topk_lp, 1)
            ar = torch.arange(self.k, device=dev).expand_as(tk_ids)
            tk_ids = torch.where(mask[..., None], tk_ids, ar)
            tk_lp = torch.where(mask[..., None], tk_lp, torch.full_like(tk_lp, float("-inf")))
        self._prev = None  # free the (B, V) buffer
        out = Rollout(ids, s_lp, tk_ids, tk_lp, mask)
        return out.to(device) if device is not None else out
