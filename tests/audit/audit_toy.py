"""Tiny policies and rollout batches for the audit tests (no trainer needed).

``BigramLM``: logits at a position depend only on the current token, so a batch can be
sampled token by token from an "engine" copy with perturbed weights (a real mismatch).
``Bandit``: one position whose logits are the parameters themselves.
"""

from __future__ import annotations

import torch

from pdmask.engine.base import RolloutBatch


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
                      response_mask=mask, sampled_logprob=lp, topk_ids=tk_ids, topk_logprobs=tk_lp, logits=logits)
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
