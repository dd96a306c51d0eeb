"""Tiny causal LMs and batches for the batch-mask tests, and the per-token oracles.

``TinyLM`` is a hand-made pre-norm transformer that computes in its own dtype end to end
(transformers' Llama upcasts RMSNorm and eager softmax to float32, which spoils central
differences in float64). It has the attributes the block lookup uses: ``layers``,
``norm``, ``lm_head``.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

import pdmask
from pdmask.divergences import build_support, topk_kl, topk_tv
from tests import flat  # noqa: E402

F64 = torch.float64


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self, d, heads, ff):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x, bias):
        B, L, d = x.shape
        h, dh = self.heads, d // self.heads
        q, k, v = self.qkv(self.norm1(x)).view(B, L, 3, h, dh).permute(2, 0, 3, 1, 4)  # 3 x (B, h, L, dh)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dh) + bias, -1)
        x = x + self.o((att @ v).transpose(1, 2).reshape(B, L, d))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x)), approximate="tanh"))


class TinyLM(nn.Module):
    """Embedding + learned positions, ``layers`` blocks, final ``norm``, ``lm_head``."""

    def __init__(self, vocab=40, d=16, layers=2, heads=2, ff=32, max_pos=32, tied=False, seed=0, dtype=F64):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(max_pos, d)
            self.layers = nn.ModuleList(Block(d, heads, ff) for _ in range(layers))
            self.norm = RMSNorm(d)
            self.lm_head = nn.Linear(d, vocab, bias=False)
            for p in self.parameters():
                if p.dim() > 1:
                    nn.init.normal_(p, std=0.3)
        if tied:
            self.lm_head.weight = self.embed.weight
        self.to(dtype)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, L = input_ids.shape
        am = torch.ones(B, L, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        pos = torch.arange(L).expand(B, L) if position_ids is None else position_ids
        x = self.embed(input_ids) + self.pos(pos)
        allowed = torch.ones(L, L, dtype=torch.bool).tril()[None] & am[:, None, :]  # (B, L, L)
        bias = torch.where(allowed, 0.0, -1e9).to(x.dtype)[:, None]  # (B, 1, L, L); finite: no NaN rows
        for blk in self.layers:
            x = blk(x, bias)
        return self.lm_head(self.norm(x))


def tiny_llama(*, vocab=48, d=32, layers=2, tied=True, dtype=F64, seed=0, arch="llama"):
    """A transformers LlamaForCausalLM (or Qwen3) built from a config (nothing downloaded)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                  tie_word_embeddings=tied)
    cfg = LlamaConfig(**common) if arch == "llama" else Qwen3Config(head_dim=d // 4, **common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        m = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return m.eval()


def make_batch(model, *, B=3, P=4, T=6, V=None, K=5, seed=0, temperature=1.0, mismatch=0.5):
    """A rollout batch for ``model``: left-padded prompts, right-padded responses, a rollout
    policy mu = the model's own logits + noise (so that some tokens are out of region)."""
    g = torch.Generator().manual_seed(seed)
    V = V or model.lm_head.weight.shape[0]
    L = P + T
    ids = torch.randint(0, V, (B, L), generator=g)
    am = torch.ones(B, L, dtype=torch.bool)
    am[0, :2] = False  # left padding of one prompt
    rmask = torch.ones(B, T, dtype=torch.bool)
    rmask[1, -2:] = False  # right padding of one response
    am[:, P:] = rmask
    with torch.no_grad():
        pos = (am.long().cumsum(-1) - 1).clamp(min=0)
        z = model(input_ids=ids[:, :-1], attention_mask=am[:, :-1].long(), position_ids=pos[:, :-1])
        z = getattr(z, "logits", z)[:, -T:].double()
    logmu = torch.log_softmax((z + mismatch * torch.randn(z.shape, generator=g, dtype=F64)) / temperature, -1)
    top = logmu.topk(K, -1)
    k = ids[:, P:]
    adv = torch.tensor([1.3, -0.8, 0.6, -1.1, 0.9, -0.4][:B], dtype=F64)
    return dict(input_ids=ids, attention_mask=am, response_mask=rmask,
                rollout_logprob=logmu.gather(-1, k[..., None])[..., 0], rollout_topk_ids=top.indices,
                rollout_topk_logprobs=top.values, advantages=adv)


def logits_of(model, batch, named: dict | None = None):
    """(B, T, V) response logits, optionally with replaced parameters (functional_call)."""
    ids, am = batch["input_ids"], batch["attention_mask"]
    T = batch["response_mask"].shape[1]
    pos = (am.long().cumsum(-1) - 1).clamp(min=0)[:, :-1]
    kw = dict(input_ids=ids[:, :-1], attention_mask=am[:, :-1].long())
    if "position_ids" in inspect.signature(model.forward).parameters:
        kw["position_ids"] = pos
    if named is None:
        out = model(**kw)
    else:
        out = torch.func.functional_call(model, named, (), kw, tie_weights=False, strict=False)
    return getattr(out, "logits", out)[:, -T:]


def naive_divergence(logits, batch, divergence, temperature=1.0):
    """(B, T) differentiable top-K divergence through log_softmax + the core's bucketing."""
    B, T, V = logits.shape
    ids = batch["input_ids"][:, -T:].reshape(-1)
    logq = torch.log_softmax(logits.reshape(-1, V) / temperature, -1)
    tk = batch["rollout_topk_ids"].reshape(-1, batch["rollout_topk_ids"].shape[-1])
    sup = build_support(ids, logq.gather(1, ids[:, None])[:, 0], batch["rollout_logprob"].reshape(-1), tk,
                        logq.gather(1, tk), batch["rollout_topk_logprobs"].reshape(tk.shape),
                        logq.exp().pow(2).sum(-1), V)
    return (topk_kl(sup) if divergence == "topk_kl" else topk_tv(sup)).reshape(B, T)


def region_and_weights(model, batch, *, divergence="topk_kl", delta=0.05, temperature=1.0, is_cap=5.0):
    """O (B, T) bool and the IS weight w (B, T) from the core's statistics at the current theta."""
    with torch.no_grad():
        z = logits_of(model, batch)
    T = z.shape[1]
    st = flat.token_stats(z, batch["input_ids"][:, -T:], batch["rollout_logprob"], batch["rollout_topk_ids"],
                            batch["rollout_topk_logprobs"], response_mask=batch["response_mask"],
                            temperature=temperature)
    A = batch["advantages"][:, None].expand(z.shape[:2])
    A = torch.where(batch["response_mask"], A, torch.zeros_like(A))
    O = (st[divergence] > delta) & (A != 0) & batch["response_mask"]
    w = st["log_ratio"].clamp(max=math.log(is_cap)).exp()
    return O, w, A, st


def per_token_oracle(model, batch, params, diag=None, *, divergence="topk_kl", delta=0.05, temperature=1.0):
    """ddot_t = <grad log pi_t, P grad Phi> by an explicit per-token autograd loop over
    the model's ordinary parameters ``params`` (a list), through log_softmax (no closed forms)."""
    O, w, A, _ = region_and_weights(model, batch, divergence=divergence, delta=delta, temperature=temperature)
    z = logits_of(model, batch)
    T = z.shape[1]
    phi = (naive_divergence(z, batch, divergence, temperature) * O).sum()
    gphi = torch.autograd.grad(phi, params, retain_graph=True, allow_unused=True)
    gphi = [torch.zeros_like(p) if g is None else g for p, g in zip(params, gphi)]
    v = [g * (1.0 if diag is None else d) for g, d in zip(gphi, diag or [None] * len(gphi))]
    logp = torch.log_softmax(z / temperature, -1).gather(-1, batch["input_ids"][:, -T:, None])[..., 0]
    ddot = torch.zeros_like(logp)
    for b in range(logp.shape[0]):
        for t in range(T):
            if batch["response_mask"][b, t]:
                gt = torch.autograd.grad(logp[b, t], params, retain_graph=True, allow_unused=True)
                ddot[b, t] = sum((g * x).sum() for g, x in zip(gt, v) if g is not None)
    return ddot.detach(), O, w, A
