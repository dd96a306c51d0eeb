"""Turning engine output into rewards, and held-out greedy evaluation.

- :func:`rollout_step` — generate -> rewards -> advantages for a set of prompts: the
  rollout half of an RL step (the training loop and the direction audit both use it).
- :func:`decode_responses` — response strings of a :class:`RolloutBatch` (EOS dropped).
- :func:`rewards_for` — (B,) float32 rewards from a reward function.
- :func:`group_advantages` — GRPO advantages per sequence.
- :func:`greedy_eval` — held-out greedy decoding, scored.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import torch

from ..engine.base import RolloutBatch
from ..engine.hf import sample


def decode_responses(tokenizer, batch: RolloutBatch) -> list[str]:
    ids = batch.response_ids
    out = []
    for row, m in zip(ids.tolist(), batch.response_mask.tolist()):
        toks = [t for t, keep in zip(row, m) if keep and t != tokenizer.eos_token_id]
        out.append(tokenizer.decode(toks, skip_special_tokens=True))
    return out


def rewards_for(texts: list[str], answers: list[str], reward_fn) -> torch.Tensor:
    """(B,) float32 rewards; a reward function returning NaN is an error, not a silent 0."""
    vals = []
    for i, (t, a) in enumerate(zip(texts, answers)):
        v = reward_fn(t, a)
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if not isinstance(v, (int, float)) or not math.isfinite(v):  # bools are ints: 0/1 rewards
            what = "NaN" if isinstance(v, float) and math.isnan(v) else f"{v!r} ({type(v).__name__})"
            raise ValueError(f"reward: the reward function returned {what} for response {i}; "
                             "it must return a finite number")
        vals.append(float(v))
    return torch.tensor(vals, dtype=torch.float32)


def group_advantages(rewards: torch.Tensor, group_size: int, *, std_norm: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages (B,) of rewards (B,) laid out as consecutive groups of ``group_size``.

    ``A_i = r_i - mean(group)`` and, with ``std_norm``, divided by ``std(group) + eps``
    (population std, as verl's GRPO; a group with equal rewards gets A = 0).
    Naive: ``for g in groups: A[g] = (r[g] - r[g].mean()) / (r[g].std(unbiased=False) + eps)``.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards: expected shape (B,) with B divisible by group_size={group_size}, "
                         f"got {tuple(rewards.shape)}")
    g = rewards.reshape(-1, group_size)  # (G, n)
    a = g - g.mean(-1, keepdim=True)
    if std_norm:
        a = a / (g.std(-1, unbiased=False, keepdim=True) + eps)
    return a.reshape(-1)


@dataclass
class RolloutStep:
    """One rollout step's output: ``B = len(prompts) * group_size`` rows, groups consecutive."""

    batch: RolloutBatch  # tokens, log mu_k (B, T), top-K of mu (B, T, K)
    rewards: torch.Tensor  # (B,) float32
    advantages: torch.Tensor  # (B,) float32
    group_size: int
    eos_id: int | None = None  # the tokenizer's end of sequence: finish_rate is logged when known

    @property
    def metrics(self) -> dict[str, torch.Tensor]:
        """What the training loop logs of the rollout (0-dim tensors, no host sync)."""
        r, a = self.rewards, self.advantages
        return {"reward": r.mean(), "train_accuracy": (r > 0.5).float().mean(),
                "response_length": self.batch.response_mask.sum(1).float().mean(),
                "zero_adv_frac": (a == 0).float().mean(),
                # answers that end within max_new_tokens: the first-number reward does not
                # punish a response that never ends, so this is watched beside the reward
                **({"finish_rate": response_shape(self.batch, self.eos_id)[0].float().mean()}
                   if self.eos_id is not None else {})}

    @property
    def flat_group_frac(self) -> torch.Tensor:
        """Share of groups whose rewards are all equal (their advantages are all 0)."""
        return (self.rewards.reshape(-1, self.group_size).std(-1, unbiased=False) == 0).float().mean()


def response_shape(batch: RolloutBatch, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ended (B,) bool, tail (B, T) float64)``: which responses write EOS within the budget,
    and the engine's probability mass beyond its reported top-K per position,
    ``1 - sum_k mu_k`` (what the engine's K leaves out; the core's ``rollout_tail_mass`` is
    the mass beyond the top-K *and* the sampled token)."""
    m = batch.response_mask.bool()
    ended = ((batch.response_ids == eos_id) & m).any(1)
    tail = (1.0 - batch.rollout.topk_logprobs.double().exp().sum(-1)).clamp_min(0.0)
    return ended, tail


def zero_advantage_warning(ro: RolloutStep) -> str | None:
    """One line, with counts, when no response token of the batch has A != 0, else None.

    Every group is flat then (all its samples got the same reward), so the batch carries no
    policy-gradient signal: a task too hard (all 0) or too easy (all 1) for the model at
    this temperature, or a reward that never fires. One host sync."""
    active = (ro.advantages != 0)[:, None] & ro.batch.response_mask.bool()  # (B, T)
    if bool(active.any()):
        return None
    r = ro.rewards
    n_groups = r.numel() // ro.group_size
    return (f"no token with A != 0 in this batch: all {n_groups} groups are flat ({int((r > 0.5).sum())} of "
            f"{r.numel()} samples rewarded, mean reward {float(r.mean()):.3f}, "
            f"{int(ro.batch.response_mask.sum())} response tokens); it has no policy-gradient signal")


def rollout_step(engine, tokenizer, prompts: list[list[int]], answers: list[str], reward_fn, *, group_size: int,
                 max_new_tokens: int, seed: int, std_norm: bool = True, return_logits: bool = False) -> RolloutStep:
    """Sample ``group_size`` responses to each prompt, reward them, GRPO advantages.

    Args:
        engine: a :class:`pdmask.engine.RolloutEngine`.
        tokenizer: decodes the responses for the reward function.
        prompts: token ids of each prompt (P prompts); each is sampled ``group_size``
            times, the copies consecutive (a group).
        answers: the reference answer of each prompt (P).
        reward_fn: ``reward_fn(response_text, answer) -> float``.
        seed: the engine's sampling seed (a pure function of the step keeps runs
            reproducible and resumable).
        std_norm: divide by the group's std (see :func:`group_advantages`).
        return_logits: also fetch the engine's full logits (``batch.logits``, (B, T, V)).
    """
    if len(prompts) != len(answers):
        raise ValueError(f"answers: expected one per prompt ({len(prompts)}), got {len(answers)}")
    batch = engine.generate([p for p in prompts for _ in range(group_size)], max_new_tokens=max_new_tokens,
                            seed=seed, return_logits=return_logits)
    rewards = rewards_for(decode_responses(tokenizer, batch), [a for a in answers for _ in range(group_size)],
                          reward_fn)  # (B,)
    adv = group_advantages(rewards, group_size, std_norm=std_norm)  # (B,)
    return RolloutStep(batch, rewards, adv, group_size, getattr(tokenizer, "eos_token_id", None))


@torch.no_grad()
def greedy_eval(model, tokenizer, prompt_ids: list[list[int]], answers: list[str], rewards: dict, *,
                max_new_tokens: int, batch_size: int = 256, texts: list | None = None) -> dict[str, float]:
    """Greedy decoding on held-out prompts, scored by several reward functions.

    Returns ``{name: mean reward for each name in rewards, "length": mean response length,
    "finished": share of responses that end (write EOS) within max_new_tokens}``; ``texts``, when
    given, receives every decoded response in prompt order."""
    was_training = model.training
    model.eval()
    total = dict.fromkeys(rewards, 0.0)
    length = finished = 0.0
    for s in range(0, len(prompt_ids), batch_size):
        b = sample(model, prompt_ids[s:s + batch_size], max_new_tokens=max_new_tokens,
                   eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, greedy=True, top_k_logprobs=1)
        decoded = decode_responses(tokenizer, b)
        if texts is not None:
            texts.extend(decoded)
        for name, fn in rewards.items():
            total[name] += float(rewards_for(decoded, answers[s:s + batch_size], fn).sum())
        length += float(b.response_mask.sum())
        finished += float(response_shape(b, tokenizer.eos_token_id)[0].sum())
    model.train(was_training)
    n = max(len(prompt_ids), 1)
    return {**{k: v / n for k, v in total.items()}, "length": length / n, "finished": finished / n}
