"""TopKRecorder: what it records on the transformers generate path is the distribution
the tokens were sampled from."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="needs the trl extra: pip install -e '.[trl]' (run .ci/trl.sh)")
sys.path.insert(0, str(Path(__file__).parent))
from tiny_lm import tiny_model, tiny_tokenizer  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

from pdmask.integrations.trl import TopKRecorder  # noqa: E402


def _generate(model, tok, gc, k, seed=0):
    enc = tok(["say a b :", "count c :", "repeat d e f :"], return_tensors="pt", padding=True)
    rec = TopKRecorder(k, gc)
    torch.manual_seed(seed)
    out = model.generate(**enc, generation_config=gc, logits_processor=[rec], output_scores=True,
                         return_dict_in_generate=True)
    P = enc["input_ids"].shape[1]
    seqs = out.sequences
    comp = []
    for row in seqs[:, P:].tolist():  # cut after the first EOS, as TRL does
        comp.append(row[: row.index(1) + 1] if 1 in row else row)
    return enc, out, rec.finish(comp), comp, P


def _truncate(z, top_k, top_p):
    """Independent top-k / top-p (keep the smallest prefix with mass >= top_p) on (V,)."""
    z = z.clone()
    if top_k:
        z[z < z.topk(top_k).values[-1]] = float("-inf")
    if top_p < 1.0:
        srt, idx = z.sort(descending=True)
        p = srt.softmax(-1)
        drop = (p.cumsum(-1) - p) >= top_p
        z[idx[drop]] = float("-inf")
    return z


@pytest.mark.parametrize("T,top_k,top_p,K", [(0.7, 0, 1.0, 4), (1.3, 0, 1.0, 1), (0.9, 3, 1.0, 5), (1.0, 0, 0.8, 4)])
def test_recorded_topk_is_the_sampling_distribution(T, top_k, top_p, K):
    model, tok = tiny_model(), tiny_tokenizer()
    model.eval()
    gc = GenerationConfig(do_sample=True, temperature=T, top_k=top_k, top_p=top_p, max_new_tokens=6,
                          pad_token_id=0, eos_token_id=1)
    enc, out, r, comp, P = _generate(model, tok, gc, K)
    S = len(out.scores)
    assert r.topk_ids.shape == (3, S, K)
    assert r.response_mask.sum(-1).tolist() == [len(c) for c in comp]
    # 1) against generate's own processed scores (after temperature and the warpers)
    for t in range(S):
        ref = torch.log_softmax(out.scores[t].float(), -1)  # (B, V)
        v, i = ref.topk(K, -1)
        m = r.response_mask[:, t]
        torch.testing.assert_close(r.topk_logprobs[m, t], v[m], atol=1e-5, rtol=0)
        torch.testing.assert_close(r.topk_logprobs[m, t], ref[m].gather(1, r.topk_ids[m, t]), atol=1e-5, rtol=0)
        s = r.sampled_ids[m, t]
        torch.testing.assert_close(r.sampled_logprob[m, t], ref[m].gather(1, s[:, None]).squeeze(1),
                                   atol=1e-5, rtol=0)
    # 2) against an independent teacher-forced forward: log_softmax(trunc(logits / T))
    with torch.no_grad():
        am = torch.zeros_like(out.sequences)  # from the lengths: the model may sample the pad id itself
        am[:, :P] = enc["attention_mask"]
        for b, c in enumerate(comp):
            am[b, P:P + len(c)] = 1
        pos = (am.cumsum(-1) - 1).clamp(min=0)  # left padding: positions as generate counts them
        logits = model(input_ids=out.sequences, attention_mask=am, position_ids=pos).logits[:, P - 1:-1].float()
    for b in range(3):
        for t in range(len(comp[b])):
            ref = torch.log_softmax(_truncate(logits[b, t] / T, top_k, top_p), -1)
            torch.testing.assert_close(r.topk_logprobs[b, t], ref[r.topk_ids[b, t]], atol=1e-4, rtol=0)
            torch.testing.assert_close(r.topk_logprobs[b, t], ref.topk(K).values, atol=1e-4, rtol=0)
            assert float(r.sampled_logprob[b, t]) == pytest.approx(float(ref[comp[b][t]]), abs=1e-4)
    if top_k and K > top_k:  # truncated tokens are reported at -inf; the kept mass sums to 1
        assert torch.isinf(r.topk_logprobs[r.response_mask][:, top_k:]).all()
        torch.testing.assert_close(r.topk_logprobs[r.response_mask].exp().sum(-1),
                                   torch.ones(int(r.response_mask.sum())), atol=1e-5, rtol=0)


def test_recorder_rejects_misuse():
    gc = GenerationConfig(do_sample=False)
    with pytest.raises(ValueError, match="do_sample"):
        TopKRecorder(2, gc)
    with pytest.raises(ValueError, match="^k:"):
        TopKRecorder(-1, GenerationConfig(do_sample=True))
    with pytest.raises(ValueError, match="typical_p"):
        TopKRecorder(2, GenerationConfig(do_sample=True, typical_p=0.5))
    model, tok = tiny_model(), tiny_tokenizer()
    gc = GenerationConfig(do_sample=True, max_new_tokens=3, pad_token_id=0, eos_token_id=1)
    enc, out, r, comp, P = _generate(model, tok, gc, 2)
    rec = TopKRecorder(2, gc)
    torch.manual_seed(1)
    model.generate(**enc, generation_config=gc, logits_processor=[rec])
    wrong = [[(c[0] + 1) % 20 + 4] + c[1:] if c else c for c in comp]  # a different first token
    with pytest.raises(RuntimeError, match="differ"):
        rec.finish(wrong)
