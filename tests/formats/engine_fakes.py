"""Stand-ins shaped exactly like vLLM's and SGLang's output objects, and a reference
sampler that fills them the way the real engines do (vLLM 0.32 ``Sampler.gather_logprobs``
+ ``append_logprobs_for_next_position``; SGLang 0.5 ``detokenize_*_tokens``).

Written from the engines' source, in our own words; no engine import.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch


@dataclass
class Logprob:  # vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FlatLogprobs:  # vllm.logprobs.FlatLogprobs (the parts a reader touches)
    start_indices: list = field(default_factory=list)
    end_indices: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    ranks: list = field(default_factory=list)
    decoded_tokens: list = field(default_factory=list)

    def append_fast(self, token_ids, logprobs, ranks, decoded_tokens):
        self.start_indices.append(len(self.logprobs))
        for a, b, c, d in zip(token_ids, logprobs, ranks, decoded_tokens):
            self.token_ids.append(a)
            self.logprobs.append(b)
            self.ranks.append(c)
            self.decoded_tokens.append(d)
        self.end_indices.append(len(self.logprobs))

    def __len__(self):
        return len(self.start_indices)

    def __getitem__(self, i):
        return {self.token_ids[j]: Logprob(self.logprobs[j], self.ranks[j], self.decoded_tokens[j])
                for j in range(self.start_indices[i], self.end_indices[i])}

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]


@dataclass
class CompletionOutput:  # vllm.outputs.CompletionOutput (fields read)
    index: int
    text: str
    token_ids: list
    cumulative_logprob: float | None
    logprobs: object
    finish_reason: str | None = None


@dataclass
class RequestOutput:  # vllm.outputs.RequestOutput (fields read)
    request_id: str
    prompt_token_ids: list
    outputs: list


@dataclass
class SamplingParams:  # vllm.SamplingParams (fields read)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    flat_logprobs: bool = False


def append_position(container, token_ids, logprobs, rank, num_logprobs):
    """vLLM's ``append_logprobs_for_next_position``: sampled first, then ranks 1..K."""
    ranks = itertools.chain((rank,), range(1, num_logprobs + 1))
    decoded = [None] * len(token_ids)
    if isinstance(container, FlatLogprobs):
        container.append_fast(token_ids, logprobs, ranks, decoded)
    else:  # a dict: a sampled token in the top-K is overwritten by its top-K entry
        container.append({t: Logprob(lp, r, d) for t, lp, r, d in zip(token_ids, logprobs, ranks, decoded)})


def truncate(z: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """top-k then top-p on temperature-scaled logits (V,): truncated -> -inf."""
    z = z.clone()
    if top_k and top_k < z.numel():
        kth = z.topk(top_k).values[-1]
        z[z < kth] = float("-inf")
    if top_p < 1.0:
        srt, idx = z.sort(descending=True)
        cum = srt.softmax(-1).cumsum(-1)
        drop = (cum - srt.softmax(-1)) >= top_p  # keep the smallest prefix with mass >= top_p
        z[idx[drop]] = float("-inf")
    return z


def vllm_sample(logits: torch.Tensor, lengths, *, k: int, temperature=1.0, top_k=0, top_p=1.0,
                mode="processed_logprobs", flat=False, seed=0, force=None):
    """Sample from (B, T, V) logits like vLLM; return (CompletionOutputs, reference dict).

    ``force``: optional {(b, t): token} to pin a sampled token (to hit a case).
    The reference holds the processed log-probs (B, T, V) and the sampled ids.
    """
    g = torch.Generator().manual_seed(seed)
    B, T, V = logits.shape
    outs = []
    ref_lp = torch.full((B, T, V), float("nan"), dtype=torch.float32)
    ref_ids = torch.zeros(B, T, dtype=torch.int64)
    for b in range(B):
        container = FlatLogprobs() if flat else []
        ids = []
        for t in range(lengths[b]):
            raw = logits[b, t].float()
            proc = torch.log_softmax(truncate(raw / temperature, top_k, top_p), -1)
            s = int(torch.multinomial(proc.exp(), 1, generator=g))
            if force and (b, t) in force:
                s = force[(b, t)]
            rep = proc if mode == "processed_logprobs" else torch.log_softmax(raw, -1)
            topv, topi = rep.topk(k)
            rank = int((rep >= rep[s]).sum())
            append_position(container, [s] + topi.tolist(), [float(rep[s])] + topv.tolist(), rank, k)
            ids.append(s)
            ref_lp[b, t] = rep
            ref_ids[b, t] = s
        outs.append(RequestOutput(str(b), [1, 2], [CompletionOutput(0, "", ids, None, container)]))
    return outs, {"logprobs": ref_lp, "sampled_ids": ref_ids}


def trl_extract(outputs):
    """TRL 1.16 ``extract_logprobs``: per position, entries sorted by rank."""
    all_lp, all_ids = [], []
    for ro in outputs:
        for o in ro.outputs:
            seq_lp, seq_ids = [], []
            for d in o.logprobs:
                items = sorted(d.items(), key=lambda kv: kv[1].rank)
                seq_ids.append([t for t, _ in items])
                seq_lp.append([x.logprob for _, x in items])
            all_lp.append(seq_lp)
            all_ids.append(seq_ids)
    return all_lp, all_ids


def sglang_results(logits: torch.Tensor, lengths, *, k: int, temperature=1.0, seed=0, flat=None, force=None):
    """Results shaped like SGLang's ``Engine.generate`` with ``return_logprob=True,
    top_logprobs_num=k``: log_softmax(logits / T), top-K sorted, sampled token separate.
    ``flat``: None (nested), "list" or "b64" (``return_flat_raw_output_top_logprobs``)."""
    import base64

    g = torch.Generator().manual_seed(seed)
    B, T, V = logits.shape
    res = []
    for b in range(B):
        tok, top, vals, idx = [], [], [], []
        out_ids = []
        for t in range(lengths[b]):
            lp = torch.log_softmax(logits[b, t].float() / temperature, -1)
            s = int(torch.multinomial(lp.exp(), 1, generator=g))
            if force and (b, t) in force:
                s = force[(b, t)]
            tv, ti = lp.topk(k)
            tok.append((float(lp[s]), s, None))
            top.append([(float(v), int(i), None) for v, i in zip(tv, ti)])
            vals.append(tv.tolist())
            idx.append(ti.tolist())
            out_ids.append(s)
        meta = {"output_token_logprobs": tok, "output_token_logprobs_length": len(tok)}
        if flat is None:
            meta["output_top_logprobs"] = top
        else:
            meta["output_top_logprobs_shape"] = [len(vals), k]
            meta["output_top_logprobs_null_prefix"] = 0
            if flat == "list":
                meta["output_top_logprobs_val_flat"] = [v for r in vals for v in r]
                meta["output_top_logprobs_idx_flat"] = [i for r in idx for i in r]
            else:
                va = torch.tensor(vals, dtype=torch.float32).reshape(-1).numpy().tobytes()
                ia = torch.tensor(idx, dtype=torch.int32).reshape(-1).numpy().tobytes()
                meta["output_top_logprobs_val_flat_b64"] = base64.b64encode(va).decode()
                meta["output_top_logprobs_idx_flat_b64"] = base64.b64encode(ia).decode()
                meta["output_top_logprobs_val_flat_b64_dtype"] = "float32"
                meta["output_top_logprobs_idx_flat_b64_dtype"] = "int32"
        res.append({"text": "", "output_ids": out_ids, "meta_info": meta})
    return res
