"""Engine top-K formats -> (B, T, K) tensors: vLLM dicts / FlatLogprobs, TRL lists, SGLang.

The fakes in ``engine_fakes.py`` fill vLLM/SGLang-shaped objects from known logits the
way the engines do; the converter must give back exactly the top-K and sampled-token
log-probs of those logits.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import engine_fakes as F  # noqa: E402

import pdmask  # noqa: E402
from pdmask.formats.sglang import check_sglang_semantics, from_sglang  # noqa: E402
from pdmask.formats.vllm import (  # noqa: E402
    EngineSemanticsWarning, check_sampling_semantics, from_ranked_lists, from_vllm_logprobs,
    from_vllm_outputs, logprobs_mode_of,
)
from tests import flat  # noqa: E402

L = F.Logprob


def _logits(B=3, T=5, V=11, seed=0, scale=2.0):
    return torch.randn(B, T, V, generator=torch.Generator().manual_seed(seed)) * scale


def _check_against_reference(r, ref, lengths, k):
    """Converter output == top-K / sampled log-probs of the reference log-probs."""
    B = len(lengths)
    for b in range(B):
        n = lengths[b]
        assert r.response_mask[b, :n].all() and not r.response_mask[b, n:].any()
        for t in range(n):
            lp = ref["logprobs"][b, t]
            s = int(ref["sampled_ids"][b, t])
            assert int(r.sampled_ids[b, t]) == s
            assert float(r.sampled_logprob[b, t]) == pytest.approx(float(lp[s]), abs=1e-6)
            # top-K: same set and values as torch.topk of the reference (ties aside)
            got_ids = r.topk_ids[b, t]
            assert len(set(got_ids.tolist())) == k
            torch.testing.assert_close(r.topk_logprobs[b, t], lp[got_ids], rtol=0, atol=1e-6)
            torch.testing.assert_close(r.topk_logprobs[b, t], lp.topk(k).values, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ vLLM
@pytest.mark.parametrize("flat", [False, True], ids=["dict", "flat"])
@pytest.mark.parametrize("k", [1, 3])
def test_vllm_matches_engine_logprobs(flat, k):
    lengths = [5, 2, 4]  # ragged
    logits = _logits()
    outs, ref = F.vllm_sample(logits, lengths, k=k, temperature=0.7, flat=flat, seed=k)
    r = from_vllm_outputs(outs, k=k, logprobs_mode="processed_logprobs")
    assert r.topk_ids.shape == (3, 5, k) and r.sampled_logprob.shape == (3, 5)
    assert r.topk_ids.dtype == torch.int64 and r.topk_logprobs.dtype == torch.float32
    _check_against_reference(r, ref, lengths, k)


@pytest.mark.parametrize("flat", [False, True], ids=["dict", "flat"])
def test_vllm_sampled_outside_topk_is_not_rank1(flat):
    # V = 6, K = 2. Position 0 samples the least likely token (outside the top-2: K+1
    # entries), position 1 samples the rank-2 token (inside: K entries in the dict).
    logits = torch.tensor([[[4.0, 3.0, 2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 2.5, -1.0, -2.0]]])
    outs, ref = F.vllm_sample(logits, [2], k=2, flat=flat, force={(0, 0): 5, (0, 1): 3})
    d0 = outs[0].outputs[0].logprobs[0]
    assert len(d0) == 3  # K + 1
    d1 = outs[0].outputs[0].logprobs[1]
    assert len(d1) == 2 if not flat else len(outs[0].outputs[0].logprobs.token_ids) == 6
    r = from_vllm_outputs(outs, k=2)
    lp0 = torch.log_softmax(logits[0, 0], -1)
    assert float(r.sampled_logprob[0, 0]) == pytest.approx(float(lp0[5]), abs=1e-6)
    assert float(r.sampled_logprob[0, 0]) != pytest.approx(float(lp0[0]), abs=1e-3)  # not rank 1
    assert r.topk_ids[0, 0].tolist() == [0, 1]  # the sampled token (5) is dropped from top-K
    lp1 = torch.log_softmax(logits[0, 1], -1)
    assert r.topk_ids[0, 1].tolist() == [1, 3]
    assert float(r.sampled_logprob[0, 1]) == pytest.approx(float(lp1[3]), abs=1e-6)


def test_vllm_flat_tie_keeps_topk_rank():
    # Tokens 0 and 1 tie for the top. vLLM's rank of the sampled token is the number of
    # tokens with a log-prob >= its own, so sampling token 0 gives it rank 2 in the first
    # (sampled) entry while the top-K list has it at rank 1: two entries, one id.
    flat = F.FlatLogprobs()
    F.append_position(flat, [0, 0, 1], [-0.7, -0.7, -0.7], rank=2, num_logprobs=2)
    r = from_vllm_logprobs([flat], [[0]], k=2)
    assert r.topk_ids[0, 0].tolist() == [0, 1]
    assert float(r.sampled_logprob[0, 0]) == pytest.approx(-0.7)


def test_vllm_inf_entries_from_truncation_are_kept():
    # processed_logprobs with top_k=2 sampling and K=4 returned: ranks 3, 4 are -inf.
    logits = _logits(B=2, T=3, V=9, seed=3)
    outs, ref = F.vllm_sample(logits, [3, 3], k=4, top_k=2, temperature=0.9, flat=True)
    r = from_vllm_outputs(outs, k=4, logprobs_mode="processed_logprobs")
    assert torch.isinf(r.topk_logprobs[:, :, 2:]).all() and torch.isfinite(r.topk_logprobs[:, :, :2]).all()
    assert torch.isfinite(r.sampled_logprob).all()
    for b in range(2):
        for t in range(3):
            assert len(set(r.topk_ids[b, t].tolist())) == 4
    # mass of the kept set is renormalised to 1
    torch.testing.assert_close(r.topk_logprobs.exp().sum(-1), torch.ones(2, 3), atol=1e-5, rtol=0)
    # and the core library accepts them (no NaN from the -inf entries)
    out = flat.policy_loss(logits.requires_grad_(), r.sampled_ids, r.sampled_logprob, r.topk_ids,
                             r.topk_logprobs, torch.ones(2), r.response_mask, temperature=0.9)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert torch.isfinite(logits.grad).all()


def test_vllm_smaller_k_than_engine():
    logits = _logits(seed=5)
    outs, ref = F.vllm_sample(logits, [5, 5, 5], k=5, flat=False)
    r = from_vllm_outputs(outs, k=2)
    _check_against_reference(r, ref, [5, 5, 5], 2)


def test_vllm_k_zero_and_k_default_from_sampling_params():
    logits = _logits(seed=6)
    outs, ref = F.vllm_sample(logits, [5, 1, 3], k=3)
    r0 = from_vllm_outputs(outs, k=0)
    assert r0.topk_ids is None and r0.topk_logprobs is None
    r = from_vllm_outputs(outs, sampling_params=F.SamplingParams(logprobs=3))
    _check_against_reference(r, ref, [5, 1, 3], 3)
    torch.testing.assert_close(r0.sampled_logprob, r.sampled_logprob)


def test_vllm_padding_and_pad_to():
    logits = _logits(seed=7)
    outs, _ = F.vllm_sample(logits, [2, 0, 1], k=2)
    r = from_vllm_outputs(outs, k=2, pad_to=4, pad_id=-1)
    assert r.sampled_ids.shape == (3, 4) and r.response_mask.sum(-1).tolist() == [2, 0, 1]
    assert (r.sampled_ids[~r.response_mask] == -1).all()
    assert (r.sampled_logprob[~r.response_mask] == 0).all()
    assert torch.isinf(r.topk_logprobs[~r.response_mask]).all()
    with pytest.raises(ValueError, match="pad_to"):
        from_vllm_outputs(outs, k=2, pad_to=1)


def test_vllm_plain_float_dicts_without_ranks():
    # {id: logprob} dicts: ordered by log-prob, the sampled token last among equals.
    lp = [[{7: -3.0, 1: -0.3, 2: -2.0}, {2: -1.0, 4: -1.0, 3: -1.0}]]
    r = from_vllm_logprobs(lp, [[7, 3]], k=2)
    assert r.topk_ids[0, 0].tolist() == [1, 2]
    assert r.topk_ids[0, 1].tolist() == [2, 4]  # 3 sampled, tied, dropped
    assert r.sampled_logprob[0].tolist() == [-3.0, -1.0]


def test_vllm_flat_noncontiguous_ranges():
    flat = F.FlatLogprobs(start_indices=[3, 0], end_indices=[5, 2], token_ids=[4, 1, 0, 9, 2],
                          logprobs=[-0.1, -2.0, 0.0, -0.2, -1.0], ranks=[1, 2, None, 1, 2])
    r = from_vllm_logprobs([flat], [[9, 1]], k=2)
    assert r.topk_ids[0].tolist() == [[9, 2], [4, 1]]
    assert r.sampled_logprob[0].tolist() == pytest.approx([-0.2, -2.0])


@pytest.mark.parametrize("case,match", [
    ("missing", "no entry for the sampled token"),
    ("length", "log-prob positions"),
    ("nan", "NaN"),
    ("positive", "logits, not log-probs"),
    ("fewer", "fewer than k"),
    ("none", "has no log-probs"),
    ("sampled_inf", "-inf"),
])
def test_vllm_bad_input(case, match):
    good = [{1: L(-0.1, 1), 2: L(-2.5, 2)}]
    lp, ids, k = [good], [[1]], 2
    if case == "missing":
        ids = [[5]]
    elif case == "length":
        ids = [[1, 2]]
    elif case == "nan":
        lp = [[{1: L(math.nan, 1), 2: L(-2.5, 2)}]]
    elif case == "positive":
        lp = [[{1: L(3.2, 1), 2: L(-2.5, 2)}]]
    elif case == "fewer":
        k = 3
    elif case == "none":
        lp = [None]
    elif case == "sampled_inf":
        lp = [[{1: L(-0.1, 1), 2: L(-math.inf, 2)}]]
        ids = [[2]]
    with pytest.raises(ValueError, match=match):
        from_vllm_logprobs(lp, ids, k=k)
    with pytest.raises(ValueError, match="^k:"):
        from_vllm_logprobs([good], [[1]], k=-1)


# ------------------------------------------------------------------ semantics
def test_logprobs_mode_warnings():
    with pytest.warns(EngineSemanticsWarning, match="BEFORE temperature"):
        check_sampling_semantics(logprobs_mode="raw_logprobs", temperature=0.7)
    with pytest.warns(EngineSemanticsWarning, match="top_p=0.9"):
        check_sampling_semantics(logprobs_mode="raw_logprobs", temperature=1.0, top_p=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_sampling_semantics(logprobs_mode="processed_logprobs", temperature=0.7, top_p=0.9, top_k=5)
        check_sampling_semantics(logprobs_mode="raw_logprobs", temperature=1.0)
        check_sampling_semantics(logprobs_mode=None, temperature=0.5)
    with pytest.raises(ValueError, match="logits, not log-probs"):
        check_sampling_semantics(logprobs_mode="processed_logits", temperature=1.0)
    with pytest.raises(ValueError, match="unknown value"):
        check_sampling_semantics(logprobs_mode="processed", temperature=1.0)


def test_converter_warns_on_raw_mode_with_temperature():
    logits = _logits(seed=8)
    outs, _ = F.vllm_sample(logits, [2, 2, 2], k=2, mode="raw_logprobs", temperature=0.6)
    sp = F.SamplingParams(temperature=0.6, logprobs=2)
    with pytest.warns(EngineSemanticsWarning, match="temperature=0.6"):
        from_vllm_outputs(outs, sampling_params=sp, logprobs_mode="raw_logprobs")


def test_logprobs_mode_of():
    class MC:
        logprobs_mode = "processed_logprobs"

    class Engine:
        model_config = MC()

    class LLM:
        llm_engine = Engine()

    assert logprobs_mode_of(LLM()) == "processed_logprobs"
    assert logprobs_mode_of(object()) is None


# ------------------------------------------------------------------ TRL lists
@pytest.mark.parametrize("flat", [False, True], ids=["dict", "flat"])
def test_trl_ranked_lists(flat):
    lengths = [5, 3, 1]
    logits = _logits(seed=9)
    outs, ref = F.vllm_sample(logits, lengths, k=3, flat=flat, temperature=1.3)
    lps, lids = F.trl_extract(outs)
    comp = [o.outputs[0].token_ids for o in outs]
    r = from_ranked_lists(lps, lids, comp, k=3)
    _check_against_reference(r, ref, lengths, 3)
    # what TRL 1.16's GRPOTrainer keeps (lp[0]) is the rank-1 log-prob, not the sampled one
    lp0 = torch.tensor([s[0][0] for s in lps])
    sampled0 = r.sampled_logprob[:, 0]
    is_top1 = r.sampled_ids[:, 0] == r.topk_ids[:, 0, 0]
    torch.testing.assert_close(lp0[is_top1], sampled0[is_top1])


def test_trl_lists_tie_drops_sampled_extra():
    # server mode sorts by log-prob: the sampled token (outside the top-2) tied with the
    # 2nd entry may sort before it; it is still the one dropped
    r = from_ranked_lists([[[-0.5, -1.5, -1.5]]], [[[4, 9, 2]]], [[9]], k=2)
    assert r.topk_ids[0, 0].tolist() == [4, 2]
    with pytest.raises(ValueError, match="ids"):
        from_ranked_lists([[[-0.5, -1.5]]], [[[4]]], [[4]], k=1)


# ------------------------------------------------------------------ SGLang
@pytest.mark.parametrize("flat", [None, "list", "b64"])
def test_sglang_matches_engine_logprobs(flat):
    lengths = [4, 1, 5]
    logits = _logits(seed=10)
    res = F.sglang_results(logits, lengths, k=3, temperature=0.8, flat=flat, force={(0, 0): 10, (2, 4): 0})
    r = from_sglang(res, k=3, temperature=0.8)
    lp = torch.log_softmax(logits / 0.8, -1)
    ref = {"logprobs": lp, "sampled_ids": r.sampled_ids}
    _check_against_reference(r, ref, lengths, 3)
    assert [e[1] for e in res[0]["meta_info"]["output_token_logprobs"]] == r.sampled_ids[0, :4].tolist()
    # meta_info dicts alone work too
    r2 = from_sglang([x["meta_info"] for x in res], k=2)
    torch.testing.assert_close(r2.topk_logprobs, r.topk_logprobs[..., :2])


def test_sglang_null_is_minus_inf_and_errors():
    meta = {"output_token_logprobs": [[-0.2, 3, None]],
            "output_top_logprobs": [[[-0.2, 3, None], [None, 5, None]]]}
    r = from_sglang([meta], k=2)
    assert r.topk_logprobs[0, 0, 1] == float("-inf") and r.topk_ids[0, 0].tolist() == [3, 5]
    with pytest.raises(ValueError, match="output_ids"):
        from_sglang([{"output_ids": [4], "meta_info": meta}], k=2)
    with pytest.raises(ValueError, match="no output_top_logprobs"):
        from_sglang([{"output_token_logprobs": [[-0.2, 3, None]]}], k=2)
    with pytest.raises(ValueError, match="null"):
        from_sglang([{"output_token_logprobs": [[None, 3, None]], "output_top_logprobs": [None]}], k=0)


def test_sglang_semantics_warnings():
    with pytest.warns(EngineSemanticsWarning, match="BEFORE temperature"):
        check_sglang_semantics(temperature=0.5, return_original_logprob=True)
    with pytest.warns(EngineSemanticsWarning, match="top_p=0.95"):
        check_sglang_semantics(temperature=1.0, top_p=0.95)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_sglang_semantics(temperature=0.5)


# ------------------------------------------------------------------ into the core
def test_converted_tensors_give_the_same_loss_as_direct_ones():
    """policy_loss on converted engine output == on tensors built from the logits directly."""
    lengths = [5, 3, 4]
    T = 0.8
    mu_logits = _logits(seed=11)
    outs, ref = F.vllm_sample(mu_logits, lengths, k=4, temperature=T, flat=True)
    r = from_vllm_outputs(outs, k=4, logprobs_mode="processed_logprobs")
    mu = torch.log_softmax(mu_logits / T, -1)
    ids = ref["sampled_ids"]
    s_lp = mu.gather(-1, ids[..., None]).squeeze(-1)
    tk_lp, tk_ids = mu.topk(4, -1)
    mask = r.response_mask
    pi_logits = mu_logits + 0.3 * _logits(seed=12)
    adv = torch.tensor([1.0, -1.0, 0.5])
    for mode in ("pdm-topk-kl", "dppo-topk-tv", "grpo"):
        a = flat.policy_loss(pi_logits, r.sampled_ids, r.sampled_logprob, r.topk_ids, r.topk_logprobs,
                               adv, mask, mode=mode, temperature=T)
        b = flat.policy_loss(pi_logits, ids, s_lp, tk_ids, tk_lp, adv, mask, mode=mode, temperature=T)
        torch.testing.assert_close(a.loss, b.loss)
        assert torch.equal(a.mask, b.mask)


def test_vectorised_assembler_matches_naive_per_position():
    """Many random dict-format rows with random K/K+1 membership, against a plain loop."""
    g = torch.Generator().manual_seed(13)
    for trial in range(20):
        V, K = 12, int(torch.randint(1, 6, (1,), generator=g))
        B = 3
        lengths = torch.randint(0, 6, (B,), generator=g).tolist()
        logits = torch.randn(B, max(lengths + [1]), V, generator=g) * 3
        outs, ref = F.vllm_sample(logits, lengths, k=K, flat=bool(trial % 2), seed=trial)
        r = from_vllm_outputs(outs, k=K)
        for b, o in enumerate(outs):
            seq = o.outputs[0]
            for t, s in enumerate(seq.token_ids):
                d = seq.logprobs[t]  # dict view (FlatLogprobs.__getitem__ merges too)
                top = sorted(d.items(), key=lambda kv: kv[1].rank)[:K]
                assert r.topk_ids[b, t].tolist() == [i for i, _ in top]
                assert r.topk_logprobs[b, t].tolist() == pytest.approx([x.logprob for _, x in top])
                assert float(r.sampled_logprob[b, t]) == pytest.approx(d[s].logprob)
