"""The transformers rollout engine: its own weight copy, a precision, a KV-cached sampler.

:class:`HFEngine` holds a deep copy of a ``transformers`` causal LM in one of the
precisions of :mod:`pdmask.engine.precision` and samples with a plain loop over the
model's forward with a ``DynamicCache`` (no ``generate()``: we need the sampling
distribution's log-probs at every step and full control of the RNG).

Sampling distribution at every step: ``mu = softmax(z.float() / temperature)`` where
``z`` are the engine's raw logits in its compute dtype. Reported per generated token:
``log mu(k)`` of the sampled token and ``torch.topk(log mu, K)``. Both come from the
same float32 ``log_softmax``, so the top-K log-probs equal
``log_softmax(logits / T)`` at the top-K ids exactly (tested).

Truncated sampling (``sampling``: a :class:`pdmask.Sampling` with ``top_k`` / ``top_p`` /
``min_p``, vLLM's rules and order, :func:`pdmask.ops.sampling_kept_mask`): ``mu`` is
renormalised over the kept set before sampling, and the reported log-probs are those of the renormalised
distribution (vLLM's ``processed_logprobs``; top-K entries beyond the kept set are -inf).
The loss must then get the same parameters (it renormalises pi over the same rule).

Determinism: sampling draws from a ``torch.Generator`` seeded with ``seed`` (one per
``generate`` call); on CPU the same weights, prompts and seed give the same tokens.

:func:`sample` is the loop itself, usable with any causal LM (the trainer uses it with
``greedy=True`` on its own fp32 model for held-out evaluation).
"""

from __future__ import annotations

import copy
import inspect

import torch

from ..ops import Sampling, sampling_kept_mask
from ..rollout import Rollout
from .base import RolloutBatch, RolloutEngine
from .precision import apply_precision, check_precision, compute_dtype


def left_pad(prompts: list[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) int64 ids and (B, P) bool mask of left-padded prompts."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: need a non-empty list of non-empty token-id lists")
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), P), dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.as_tensor(p, dtype=torch.long)
        mask[i, P - len(p):] = True
    return ids, mask


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only, so left padding does not shift RoPE."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def cache_kwarg(model) -> str:
    """The name under which ``model``'s forward takes its KV cache.

    transformers 5.x renamed ``past_key_values`` to ``cache`` (the old name warns with a
    FutureWarning on every call until its removal); older releases, and models with
    their own forward, know only ``past_key_values``. Reading the signature picks the
    name the installed model accepts, so the cache is never silently dropped into
    ``**kwargs``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def truncation(sampling: Sampling | None, temperature: float) -> Sampling | None:
    """The truncation in force (None: none), checked against the engine's ``temperature``."""
    if temperature <= 0:
        raise ValueError(f"temperature: must be > 0, got {temperature}")
    if sampling is None:
        return None
    if not isinstance(sampling, Sampling):
        raise ValueError(f"sampling: must be a pdmask.Sampling (or None), got {type(sampling).__name__}")
    if sampling.temperature != float(temperature):
        raise ValueError(f"sampling: its temperature {sampling.temperature} is not the engine's temperature "
                         f"{float(temperature)}; give the same one")
    return sampling if sampling.truncated else None


def prefill(model, prompts: list[list[int]], ids: torch.Tensor, attn: torch.Tensor, pad_id: int,
            share_prefill: bool) -> tuple[torch.Tensor, dict]:
    """The prompt forward: ``(last logits (B, 1, V), {cache keyword: the KV cache})``.

    ``share_prefill``: one forward per *distinct* prompt, its KV cache copied to every row
    that repeats it (see :func:`sample`)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    kv = {cache_kwarg(model): cache}  # the same cache object is extended by every call
    if share_prefill:
        first: dict[tuple, int] = {}
        index = torch.tensor([first.setdefault(tuple(p), len(first)) for p in prompts], device=ids.device)  # (B,)
        u_ids, u_attn = left_pad([list(p) for p in first], pad_id, ids.device)  # (U, P): the longest is among them
        out = model(input_ids=u_ids, attention_mask=u_attn.long(), position_ids=position_ids(u_attn),
                    use_cache=True, logits_to_keep=1, **kv)
        cache.batch_select_indices(index)  # (U, ...) -> (B, ...) rows of the KV cache
        return out.logits[index], kv
    out = model(input_ids=ids, attention_mask=attn.long(), position_ids=position_ids(attn),
                use_cache=True, logits_to_keep=1, **kv)
    return out.logits, kv


@torch.no_grad()
def sample(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_k_logprobs: int = 20,
    seed: int = 0,
    greedy: bool = False,
    return_logits: bool = False,
    sampling: Sampling | None = None,
    share_prefill: bool = False,
) -> RolloutBatch:
    """Batched sampling with a KV cache; returns a :class:`RolloutBatch`.

    ``share_prefill``: run the prompt forward once per *distinct* prompt and copy its KV
    cache to every row that repeats it (a GRPO group is ``group_size`` copies of one
    prompt, so the prefill costs 1/G). Equal to the plain prefill up to GEMM rounding
    (other matrix shapes), not bit for bit, hence off by default: figures made without it
    reproduce exactly.

    A response ends at (and includes) its first ``eos_id``; later slots hold
    ``pad_id`` with ``response_mask`` False. ``greedy`` takes the argmax (log-probs are
    still those of ``softmax(z / temperature)``). ``sampling``: the truncation of the
    sampling distribution (module docstring; None or one that truncates nothing: off); its
    temperature must be ``temperature``.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    trunc = truncation(sampling, temperature)
    dev = next(model.parameters()).device
    V = model.get_output_embeddings().weight.shape[0]
    K = min(top_k_logprobs, V)
    ids, attn = left_pad(prompts, pad_id, dev)  # (B, P)
    B, P = ids.shape
    gen = torch.Generator(device=dev).manual_seed(int(seed))
    last, kv = prefill(model, prompts, ids, attn, pad_id, share_prefill)
    pos = attn.long().sum(-1) - 1  # (B,) position of the last prompt token
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    toks, masks, lps, tk_ids, tk_lps, raw = [], [], [], [], [], []
    for _ in range(max_new_tokens):
        z = last[:, -1].float()  # (B, V) raw logits in float32
        y = z / temperature
        if trunc is not None:  # mu renormalised over the kept set (vLLM's processed log-probs)
            y = y.masked_fill(~sampling_kept_mask(y, top_k=trunc.top_k, top_p=trunc.top_p, min_p=trunc.min_p),
                              float("-inf"))
        logq = torch.log_softmax(y, -1)  # (B, V) log mu
        if greedy:
            k = logq.argmax(-1)
        else:
            k = torch.multinomial(logq.exp(), 1, generator=gen).squeeze(1)  # (B,)
        live = ~done
        k = torch.where(live, k, torch.full_like(k, pad_id))
        top = torch.topk(logq, K, dim=-1)  # (B, K) sorted descending
        toks.append(k)
        masks.append(live)
        lps.append(logq.gather(1, k[:, None]).squeeze(1))
        tk_ids.append(top.indices)
        tk_lps.append(top.values)
        if return_logits:
            raw.append(z)
        done = done | (k == eos_id)
        attn = torch.cat([attn, live[:, None]], 1)  # finished rows append a masked pad
        if bool(done.all()):
            break
        pos = pos + 1
        last = model(input_ids=k[:, None], attention_mask=attn.long(), position_ids=pos[:, None],
                     use_cache=True, **kv).logits
    resp = torch.stack(toks, 1)  # (B, T)
    rmask = torch.stack(masks, 1)  # (B, T)
    lp = torch.where(rmask, torch.stack(lps, 1), torch.zeros_like(rmask, dtype=torch.float32))
    return RolloutBatch(
        sequences=torch.cat([ids, resp], 1),
        attention_mask=torch.cat([attn[:, :P], rmask], 1),
        prompt_len=P,
        rollout=Rollout(
            sampled_ids=resp,
            sampled_logprob=lp,
            topk_ids=torch.stack(tk_ids, 1),  # (B, T, K)
            topk_logprobs=torch.stack(tk_lps, 1),  # (B, T, K)
            response_mask=rmask,
            logits=torch.stack(raw, 1) if return_logits else None,  # (B, T, V)
        ),
    )


def response_logits(model, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                    inputs_embeds: torch.Tensor | None = None):
    """Teacher-forced logits (B, T, V) at the response positions, in the model's dtype.

    One forward over ``sequences[:, :-1]``; the logit at position ``P - 1 + t`` predicts
    response token ``t``. ``logits_to_keep`` skips the LM head on prompt positions.
    ``inputs_embeds`` (B, S - 1, H): what the forward starts from in place of the token
    embeddings (a caller that skips the bottom blocks passes the hidden state above them:
    :mod:`pdmask.train.frozen_prefix`); the attention mask and positions are the same.
    """
    T = sequences.shape[1] - prompt_len
    if T < 1:
        raise ValueError("sequences: no response positions after prompt_len")
    am = attention_mask[:, :-1]
    x = {"input_ids": sequences[:, :-1]} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
    out = model(**x, attention_mask=am.long(), position_ids=position_ids(am), use_cache=False, logits_to_keep=T)
    return out.logits  # (B, T, V)


def response_hidden(model, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                    inputs_embeds: torch.Tensor | None = None):
    """Final hidden states (B, T, H) at the response positions: what the LM head multiplies.

    The forward of :func:`response_logits` without the head: the decoder
    (``model.get_decoder()``, after its final norm) over ``sequences[:, :-1]``, then the
    last T positions. Naive equivalent:
    ``response_logits(...) == response_hidden(...) @ model.get_output_embeddings().weight.T``
    (for a head without bias or logit scaling). ``inputs_embeds``: as in :func:`response_logits`."""
    T = sequences.shape[1] - prompt_len
    if T < 1:
        raise ValueError("sequences: no response positions after prompt_len")
    am = attention_mask[:, :-1]
    x = {"input_ids": sequences[:, :-1]} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
    out = model.get_decoder()(**x, attention_mask=am.long(), position_ids=position_ids(am), use_cache=False)
    return out.last_hidden_state[:, -T:]  # (B, T, H)


class HFEngine(RolloutEngine):
    """Rollout engine over a ``transformers`` causal LM with its own weight copy.

    Args:
        model: a causal LM to copy (architecture and initial weights); the engine never
            shares storage with it.
        eos_id, pad_id: token ids that end a response / fill the padding.
        precision: ``fp32 | bf16 | fp16 | fp8 | fp8-bf16`` (see :mod:`.precision`).
        temperature: sampling temperature.
        top_k_logprobs: K of the reported top-K.
        sampling: truncated sampling, a :class:`pdmask.Sampling` with this ``temperature``
            (vLLM's rules and order; None: off); the reported log-probs are those of the
            renormalised distribution.
    """

    name = "hf"

    def __init__(self, model, *, eos_id: int, pad_id: int, precision: str = "fp32",
                 temperature: float = 1.0, top_k_logprobs: int = 20, sampling: Sampling | None = None,
                 share_prefill: bool = False):
        check_precision(precision)
        self.share_prefill = bool(share_prefill)
        self.sampling = truncation(sampling, temperature)  # checked
        if top_k_logprobs < 1:
            raise ValueError(f"top_k_logprobs: must be >= 1, got {top_k_logprobs}")
        self.precision = precision
        self.temperature = float(temperature)
        self.top_k_logprobs = int(top_k_logprobs)
        self.eos_id, self.pad_id = int(eos_id), int(pad_id)
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        # Rotary inverse frequencies are computed in float32 by every real engine; keep
        # them so (a bf16 cast of them would be a mismatch we did not ask for).
        keep32 = {n: b.clone() for n, b in self.model.named_buffers() if "inv_freq" in n}
        self.model.to(compute_dtype(precision))
        for n, b in self.model.named_buffers():
            if n in keep32:
                b.data = keep32[n]
        self.load_weights(model.state_dict())
        self.version = 0  # bumped by every load_weights after the first

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy the trainer's weights in (cast to the precision). Every parameter must be
        there (a tied head may be left out), and nothing else may be: a partial or foreign
        dict would leave old weights in place without a word. A LoRA model's own
        ``state_dict()`` is one of those; merge it first
        (:func:`pdmask.train.trainable.engine_state_dict`)."""
        have = set(state_dict)
        missing = sorted({n for n, _ in self.model.named_parameters()} - have)  # tied duplicates counted once
        unexpected = sorted(have - set(self.model.state_dict()))
        if missing or unexpected:
            raise ValueError(f"state_dict: does not fit the engine's {type(self.model).__name__}: missing "
                             f"{missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {unexpected[:3]}"
                             f"{'...' if len(unexpected) > 3 else ''} (LoRA adapters? merge them first)")
        apply_precision(self.model, state_dict, self.precision)
        self.version = getattr(self, "version", -1) + 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The engine's current (converted) weights, e.g. for checkpoints under policy lag."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Restore weights saved with :meth:`state_dict` (no precision conversion)."""
        self.model.load_state_dict(sd)

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, seed: int,
                 return_logits: bool = False) -> RolloutBatch:
        return sample(self.model, prompts, max_new_tokens=max_new_tokens, eos_id=self.eos_id,
                      pad_id=self.pad_id, temperature=self.temperature,
                      top_k_logprobs=self.top_k_logprobs, seed=seed, return_logits=return_logits,
                      share_prefill=self.share_prefill, sampling=self.sampling)

    @torch.no_grad()
    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
        return response_logits(self.model, sequences, attention_mask, prompt_len).float()
