"""A tiny policy whose logits are known in closed form, a vLLM-format rollout of a perturbed
copy of it, and the ``pdmask.policy_loss`` reference on the same logits.

Shared by the engine test (``test_verl_topk.py``) and the data-path tests
(``test_verl_data_path.py``). Needs torch and pdmask only; the per-sample arrays are made by
the replica's own converter (:func:`pdmask.integrations.verl.rollout.completion_topk_fields`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

import pdmask
from verl_helpers import load_engine_fakes
from tests import flat  # noqa: E402

V, K, TEMP = 13, 4, 0.8


class TinyLM(torch.nn.Module):
    """logits[pos] = E[token at pos] + Pe[position]: the reference needs no verl code."""

    def __init__(self, seed=0, max_len=16):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.E = torch.nn.Parameter(torch.randn(V, V, generator=g, dtype=torch.float64) * 2)
        self.Pe = torch.nn.Parameter(torch.randn(max_len, V, generator=g, dtype=torch.float64))

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, **_):
        return SimpleNamespace(logits=self.E[input_ids] + self.Pe[position_ids])


@dataclass
class Rollout:
    model: TinyLM
    prompts: list[list[int]]
    responses: list[list[int]]
    fields: list[dict]          # per sample: the replica's four pdmask_* arrays
    adv: torch.Tensor           # (B, T) float64, constant per sample

    @property
    def T(self) -> int:
        return max(len(r) for r in self.responses)


def build(seed=0, *, prompt_lens=(3, 2, 4), resp_lens=(5, 3, 6), mode_shift=1.5) -> Rollout:
    """Prompts, responses sampled token by token from mu = the model's logits + noise at
    temperature TEMP (vLLM-format outputs), the replica's arrays, random advantages."""
    from pdmask.integrations.verl.rollout import completion_topk_fields

    vllm_sample = load_engine_fakes().vllm_sample
    g = torch.Generator().manual_seed(seed)
    B = len(prompt_lens)
    model = TinyLM(seed, max_len=max(prompt_lens) + max(resp_lens))
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in prompt_lens]
    responses, fields = [], []
    for b in range(B):
        seq, comps = list(prompts[b]), []
        for t in range(resp_lens[b]):
            pos = len(seq) - 1
            noise = torch.randn(V, generator=g, dtype=torch.float64) * mode_shift
            z = (model.E[seq[pos]] + model.Pe[pos]).detach() + noise
            outs, _ = vllm_sample(z[None, None].float(), [1], k=K, temperature=TEMP, seed=seed * 100 + b * 10 + t)
            comps.append(outs[0].outputs[0])
            seq.append(comps[-1].token_ids[0])
        responses.append(seq[len(prompts[b]):])
        # the per-sample arrays exactly as the replica puts them in extra_fields: one
        # CompletionOutput holding the sample's one-token completions
        merged = SimpleNamespace(token_ids=[c.token_ids[0] for c in comps], logprobs=[c.logprobs[0] for c in comps])
        fields.append(completion_topk_fields(
            merged, k=K, logprobs_mode="processed_logprobs",
            sampling_params=SimpleNamespace(temperature=TEMP, top_p=1.0, top_k=0, min_p=0.0)))
    T = max(resp_lens)
    adv = torch.randn(B, generator=g, dtype=torch.float64)[:, None].expand(B, T).clone()
    return Rollout(model, prompts, responses, fields, adv)


def response_logits(r: Rollout, model: TinyLM | None = None) -> torch.Tensor:
    """(B, T, V) logits of ``model`` (default ``r.model``) predicting each response token, 0 on padding."""
    m = r.model if model is None else model
    B, T = len(r.prompts), r.T
    rows = []
    for b in range(B):
        seq = r.prompts[b] + r.responses[b]
        idx = torch.arange(len(r.prompts[b]) - 1, len(seq) - 1)
        z = m.E[torch.tensor(seq)[idx]] + m.Pe[idx]
        rows.append(torch.nn.functional.pad(z, (0, 0, 0, T - len(idx))))
    return torch.stack(rows)


def reference(r: Rollout, adv: torch.Tensor, mode: str, estimator: str = "exact", response_mask=None, **kw):
    """``pdmask.policy_loss`` on (B, T, V) logits computed directly from the tiny model
    (``response_mask``: another (B, T) mask in place of the responses' own)."""
    B, T = len(r.prompts), r.T
    logits = response_logits(r)
    mask = torch.zeros(B, T, dtype=torch.bool)
    ids = torch.zeros(B, T, dtype=torch.long)
    rlp = torch.zeros(B, T, dtype=torch.float32)
    tk = torch.zeros(B, T, K, dtype=torch.long)
    tl = torch.zeros(B, T, K, dtype=torch.float32)
    for b, f in enumerate(r.fields):
        n = len(r.responses[b])
        mask[b, :n] = True
        ids[b, :n] = torch.as_tensor(f["pdmask_sampled_ids"], dtype=torch.long)
        rlp[b, :n] = torch.as_tensor(f["pdmask_sampled_logprobs"])
        tk[b, :n] = torch.as_tensor(f["pdmask_topk_ids"], dtype=torch.long)
        tl[b, :n] = torch.as_tensor(f["pdmask_topk_logprobs"])
        assert ids[b, :n].tolist() == r.responses[b]
    # verl scales the logits by the temperature held as a float32 tensor
    t32 = float(torch.tensor(TEMP, dtype=torch.float32))
    # the IS cap of the verl call (clip_ratio_c = 5); the smooth modes take none (their ratio is the weight)
    cap = {"is_cap": 5.0} if pdmask.get_mode(mode).surrogate == "dppo" else {}
    kw = {"delta_low": 0.05, "delta_high": 0.07, **cap, **kw}
    if response_mask is not None:
        mask = response_mask.bool() & mask
    return flat.policy_loss(logits, ids, rlp, tk, tl, adv, mask, mode=mode, estimator=estimator,
                              temperature=t32, **kw)
