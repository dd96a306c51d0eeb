"""``anchor="old"``: pi_old from the old-log-prob forward TRL runs itself.

TRL 1.16 scores each generation batch once more, without gradients, for
``old_per_token_logps`` when the batch outlives an optimizer step
(:func:`.options.old_logps_computed`). That forward is TRL's
``_get_per_token_logps_and_entropies(self.model, ...)``, called first in
``_generate_and_score_completions``; its fused LM head returns ``log pi_k`` only. With the
old anchor the trainer answers that one call with :func:`old_logprobs`, the same forward
(same rows, same chunks of ``batch_size`` rows, no gradient) through the model's ordinary
head, as the loss's own forward computes pi: ``log pi_old`` at the sampled ids (returned to
TRL, which keeps it as ``old_per_token_logps``) and, when the generator reported a top-K, at
its top-K ids (kept for the batch dict as ``old_topk_logprobs``). No extra forward.

Naive torch of one chunk (``T`` completion tokens, ``k`` the completion ids, ``ids`` the
generator's top-K ids)::

    z = model(input_ids, attention_mask, position_ids).logits[:, -(T + 1):-1]
    lq = log_softmax(z.float() / temperature, -1)
    lq.gather(-1, k[..., None])[..., 0], lq.gather(-1, ids)
"""

from __future__ import annotations

import torch

from ...anchor import Anchor
from ...rollout import Rollout

#: elements of one (rows, V) logits block on the hidden-state path (the core's default chunk)
CHUNK_ELEMENTS = 1 << 24
#: keyword arguments of TRL's scoring forward that carry multimodal inputs (refused with the old anchor)
MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
              "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def _anchor(logits: torch.Tensor, comp: torch.Tensor, topk_ids: torch.Tensor | None, temperature: float) -> Anchor:
    """pi_old's log-probs from (b, T, V) logits at the completion ids and the top-K ids."""
    zeros = torch.zeros(comp.shape, dtype=torch.float32, device=comp.device)
    r = Rollout(comp, zeros, topk_ids, None if topk_ids is None else torch.zeros(topk_ids.shape, device=comp.device))
    return Anchor.from_logits(logits, r, temperature=temperature)


def _from_hidden(hidden: torch.Tensor, weight: torch.Tensor, comp, topk_ids, temperature: float,
                 chunk_rows: int | None) -> Anchor:
    """:func:`_anchor` of ``hidden @ weight.T`` a block of rows at a time (no (b, T, V) logits)."""
    T = comp.shape[1]
    h = hidden[:, -(T + 1):-1, :]  # position P-1+t predicts completion token t, as the loss reads it
    w = weight.to(h.dtype)
    flat_h, flat_c = h.reshape(-1, h.shape[-1]), comp.reshape(-1, 1)
    flat_k = None if topk_ids is None else topk_ids.reshape(-1, 1, topk_ids.shape[-1])
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // w.shape[0])
    lp, tk = [], []
    for s in range(0, flat_h.shape[0], rows):
        a = _anchor((flat_h[s:s + rows] @ w.T)[:, None], flat_c[s:s + rows],
                    None if flat_k is None else flat_k[s:s + rows], temperature)
        lp.append(a.sampled_logprob)
        tk.append(a.topk_logprobs)
    lp_all = torch.cat(lp).reshape(comp.shape)
    return Anchor(lp_all, None if topk_ids is None else torch.cat(tk).reshape(topk_ids.shape))


def old_logprobs(trainer, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                 batch_size: int | None, topk_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """pi_old's ``(log-probs at the sampled ids (B, T), at ``topk_ids`` (B, T, K) or None)``, float32,
    from ``model``'s no-grad forward over TRL's ``input_ids`` (prompt + completion, ``T =
    logits_to_keep``) in chunks of ``batch_size`` rows, with position ids as the loss counts them
    and the loss's head (``loss_from_hidden``: ``hidden @ lm_head.weight.T``, chunked)."""
    a = trainer.args
    T = logits_to_keep
    B = input_ids.shape[0]
    bs = batch_size or B
    lps, tks = [], []
    with torch.no_grad():
        for s in range(0, B, bs):
            ids, am = input_ids[s:s + bs], attention_mask[s:s + bs]
            comp = ids[:, -T:]
            tk = None if topk_ids is None else topk_ids[s:s + bs].to(ids.device)
            pos = (am.long().cumsum(-1) - 1).clamp(min=0)  # as generate(), vLLM and the loss count them
            with trainer.accelerator.autocast():
                if a.loss_from_hidden:
                    anc = model(input_ids=ids, attention_mask=am, position_ids=pos, pdmask_hidden_loss=lambda h, w:
                                _from_hidden(h, w, comp, tk, trainer.temperature, a.mask_chunk_size))
                else:
                    out = model(input_ids=ids, attention_mask=am, position_ids=pos, logits_to_keep=T + 1,
                                use_cache=False)
                    anc = _anchor(out.logits[:, -(T + 1):-1, :], comp, tk, trainer.temperature)
            lps.append(anc.sampled_logprob.float())
            tks.append(None if tk is None else anc.topk_logprobs.float())
    return torch.cat(lps), None if topk_ids is None else torch.cat(tks)
