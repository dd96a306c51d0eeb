"""Tiny policies and rollout batches for the audit tests (no trainer needed).

``BigramLM``: logits at a position depend only on the current token, so a batch can be
sampled token by token from an "engine" copy with perturbed weights (a real mismatch).
``Bandit``: one position whose logits are the parameters themselves.
"""

from __future__ import annotations

import torch

from pdmask.engine.base import RolloutBatch
from pdmask.rollout import Rollout


class BigramLM(torch.nn.Module):
    """Logits = head(tanh(emb[token])): an untied output embedding with a bias."""

    def __init__(self, vocab: int = 12, dim: int = 8, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(vocab, dim, generator=g))
        self.head = torch.nn.Linear(dim, vocab)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(vocab, dim, generator=g) * 1.5)
            self.head.bias.copy_(torch.randn(vocab, generator=g) * 0.5)

    @property
    def bias(self):
        return self.head.bias

    def get_output_embeddings(self):
        return self.head

    def forward(self, ids):  # (B, L) -> (B, L, V)
        return self.head(torch.tanh(self.emb[ids]))


def bigram_forward(model, sequences, attention_mask, prompt_len):
    return model(sequences)[:, prompt_len - 1:-1]


def perturbed(model: torch.nn.Module, scale: float, seed: int = 1) -> torch.nn.Module:
    import copy
    eng = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in eng.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return eng


@torch.no_grad()
def sample_batch(engine: torch.nn.Module, *, B: int = 8, P: int = 2, T: int = 6, K: int = 4, seed: int = 0,
                 temperature: float = 1.0, pad_tail: bool = True) -> tuple[RolloutBatch, torch.Tensor]:
    """Sample B responses of length T from ``engine``; the last sequence is shorter (padding)."""
    g = torch.Generator().manual_seed(seed)
    V = engine.bias.shape[0]
    seq = torch.randint(0, V, (B, P), generator=g)
    for _ in range(T):
        z = engine(seq)[:, -1] / temperature
        nxt = torch.multinomial(torch.softmax(z, -1), 1, generator=g)
        seq = torch.cat([seq, nxt], 1)
    logits = engine(seq)[:, P - 1:-1]  # (B, T, V) raw engine logits
    logq = torch.log_softmax(logits / temperature, -1)
    mask = torch.ones(B, T, dtype=torch.bool)
    if pad_tail:
        mask[-1, T // 2:] = False
    lp = logq.gather(-1, seq[:, P:, None]).squeeze(-1)
    tk_lp, tk_ids = logq.topk(K, -1)
    rb = RolloutBatch(sequences=seq, attention_mask=torch.ones_like(seq, dtype=torch.bool), prompt_len=P,
                      rollout=Rollout(seq[:, P:], lp, tk_ids, tk_lp, mask, logits=logits))
    # group-normalised rewards of two groups, as GRPO would: never all-equal
    r = torch.randint(0, 2, (B,), generator=g).float()
    r[0], r[1] = 0.0, 1.0
    adv = (r - r.mean()) / r.std().clamp(min=1e-6)
    return rb, adv


class Bandit(torch.nn.Module):
    """N independent one-position softmax policies: the parameters are the logits."""

    def __init__(self, z: torch.Tensor):  # (N, V)
        super().__init__()
        self.z = torch.nn.Parameter(z.clone())


def bandit_forward(model, sequences, attention_mask, prompt_len):
    # sequences (N, 2): [prompt = row id, response token]; one response position per row
    return model.z[sequences[:, 0]][:, None, :]  # (N, 1, V)


def tiny_llama(*, vocab: int = 40, d: int = 16, layers: int = 1, tied: bool = True, seed: int = 0,
               dtype=torch.float64):
    """A transformers LlamaForCausalLM from a config (nothing downloaded), tied or untied."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=tied)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        m = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        with torch.no_grad():  # larger weights than the default init: logits far from uniform
            for p in m.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.3)
    return m.eval()


def llama_batch(model, engine, *, B: int = 3, P: int = 3, T: int = 5, K: int = 6, seed: int = 0,
                temperature: float = 1.0) -> tuple[RolloutBatch, torch.Tensor]:
    """Random prompts + responses scored by ``engine`` (mu: its logits, top-K, log mu_k);
    one left-padded prompt, one right-padded response; (B, T) advantages, 0 on padding."""
    from pdmask.engine.hf import response_logits

    g = torch.Generator().manual_seed(seed)
    V = model.get_output_embeddings().weight.shape[0]
    seq = torch.randint(0, V, (B, P + T), generator=g)
    am = torch.ones(B, P + T, dtype=torch.bool)
    am[0, 0] = False
    rmask = torch.ones(B, T, dtype=torch.bool)
    rmask[1, -2:] = False
    am[:, P:] = rmask
    with torch.no_grad():
        z = response_logits(engine, seq, am, P).to(torch.float64)  # (B, T, V)
    logq = torch.log_softmax(z / temperature, -1)
    tk_lp, tk_ids = logq.topk(K, -1)
    lp = logq.gather(-1, seq[:, P:, None]).squeeze(-1)
    rb = RolloutBatch(sequences=seq, attention_mask=am, prompt_len=P,
                      rollout=Rollout(seq[:, P:], lp, tk_ids, tk_lp, rmask, logits=z))
    A = torch.randn(B, generator=g, dtype=torch.float64)[:, None].expand(B, T).clone()
    return rb, torch.where(rmask, A, 0.0)


# ------------------------------------------------------------------ settings
def audit_config(*, step_mode: str = "none", delta_low=None, delta_high=None, temperature=None, loss_agg=None,
                 is_cap=None, **kw):
    """An :class:`pdmask_lab.audit.AuditConfig` from the audit's step settings written flat
    (as the tests state them): the loss spec is :func:`pdmask_lab.audit.config.audit_loss`
    of a trainer loss holding ``temperature``, ``loss_agg``, ``is_cap``, with ``step_mode``
    and the deltas of O."""
    from pdmask_lab.audit import AuditConfig, audit_loss

    trainer = {"sampling": {"temperature": temperature}, "aggregation": {"loss_agg": loss_agg},
               "corrections": {"is_cap": is_cap}}
    trainer = {part: {k: v for k, v in d.items() if v is not None} for part, d in trainer.items()}
    loss = audit_loss(trainer, step_mode=step_mode, estimator=kw.get("estimator", "exact"),
                      deltas=(delta_low, delta_high), divergence=kw.get("divergence", "topk_kl"))
    return AuditConfig(loss=loss, **kw)
