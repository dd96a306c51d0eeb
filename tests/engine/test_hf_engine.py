"""The transformers rollout engine: reported log-probs, determinism, precisions, scoring."""

import warnings

import pytest
import torch

import pdmask

from tests.flat import token_stats
from pdmask.engine import make_engine
from pdmask.engine.hf import HFEngine, cache_kwarg, response_logits, sample
from pdmask.engine.precision import E4M3_MAX, fp8_roundtrip


def _engine(model, **kw):
    kw.setdefault("precision", "fp32")
    return HFEngine(model, eos_id=1, pad_id=0, top_k_logprobs=20, **kw)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_topk_logprobs_are_log_softmax_of_own_scaled_logits(tiny_model, prompts, temperature):
    eng = _engine(tiny_model, temperature=temperature)
    b = eng.generate(prompts, max_new_tokens=12, seed=3, return_logits=True)
    logq = torch.log_softmax(b.rollout.logits / temperature, -1)  # (B, T, V)
    m = b.response_mask
    assert m.sum() > 10
    # the reported top-K are the K largest entries of log_softmax(z / T), in order
    ref = torch.topk(logq, 20, -1)
    torch.testing.assert_close(b.rollout.topk_logprobs[m], ref.values[m], rtol=0, atol=1e-6)
    torch.testing.assert_close(b.rollout.topk_logprobs[m], logq.gather(-1, b.rollout.topk_ids)[m], rtol=0, atol=1e-6)
    sampled = logq.gather(-1, b.response_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(b.rollout.sampled_logprob[m], sampled[m], rtol=0, atol=1e-6)
    # with temperature != 1, these differ from the unscaled distribution
    if temperature != 1.0:
        assert (torch.log_softmax(b.rollout.logits, -1).gather(-1, b.rollout.topk_ids)[m] - b.rollout.topk_logprobs[m]).abs().max() > 1e-3


@pytest.mark.usefixtures("one_thread")  # bitwise: two runs of one seeded generation, on one thread
def test_generation_deterministic_given_seed(tiny_model, prompts):
    eng = _engine(tiny_model)
    a = eng.generate(prompts, max_new_tokens=10, seed=7)
    b = eng.generate(prompts, max_new_tokens=10, seed=7)
    c = eng.generate(prompts, max_new_tokens=10, seed=8)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.rollout.sampled_logprob, b.rollout.sampled_logprob)
    assert not torch.equal(a.sequences, c.sequences)


def test_layout_and_eos(tiny_model, prompts):
    eng = HFEngine(tiny_model, eos_id=3, pad_id=0, top_k_logprobs=5)
    b = eng.generate(prompts, max_new_tokens=30, seed=0)
    P = b.prompt_len
    assert P == max(map(len, prompts))
    for i, p in enumerate(prompts):  # left padding
        assert b.sequences[i, P - len(p):P].tolist() == p
        assert not b.attention_mask[i, :P - len(p)].any() and b.attention_mask[i, P - len(p):P].all()
    resp, m = b.response_ids, b.response_mask
    for i in range(len(prompts)):
        n = int(m[i].sum())
        assert m[i, :n].all() and not m[i, n:].any()  # right padding after the response
        if (resp[i, :n] == 3).any():  # EOS is the last real token
            assert int((resp[i, :n] == 3).nonzero()[0]) == n - 1
        assert (resp[i, n:] == 0).all()
    assert torch.equal(b.attention_mask[:, P:], m)


def test_score_matches_sampling_logits(tiny_model, prompts):
    """Teacher-forced logits over the whole sequence equal the KV-cached ones (fp32)."""
    eng = _engine(tiny_model)
    b = eng.generate(prompts, max_new_tokens=10, seed=1, return_logits=True)
    z = eng.score(b.sequences, b.attention_mask, b.prompt_len)
    m = b.response_mask
    torch.testing.assert_close(z[m], b.rollout.logits[m], rtol=1e-4, atol=1e-4)


def test_generation_uses_the_current_cache_api_without_warnings(tiny_model, prompts):
    """No FutureWarning (transformers 5 renamed ``past_key_values`` to ``cache``) on the
    engine's sampling, greedy sampling or scoring; and the cache still does its work:
    the KV-cached logits equal the teacher-forced ones (see the test above)."""
    eng = _engine(tiny_model, precision="bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        b = eng.generate(prompts, max_new_tokens=6, seed=0, return_logits=True)
        sample(tiny_model, prompts, max_new_tokens=4, eos_id=1, pad_id=0, greedy=True)
        eng.score(b.sequences, b.attention_mask, b.prompt_len)
    assert b.response_mask.sum() > 0


def test_cache_kwarg_follows_the_forward_signature(tiny_model):
    import inspect

    class OldStyle(torch.nn.Module):  # a forward that predates the rename
        def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=None, **kwargs):
            return None

    current = "cache" if "cache" in inspect.signature(tiny_model.forward).parameters else "past_key_values"
    assert cache_kwarg(tiny_model) == current
    assert cache_kwarg(OldStyle()) == "past_key_values"


def _mismatch(model, eng, b):
    with torch.no_grad():
        z = response_logits(model, b.sequences, b.attention_mask, b.prompt_len)
    st = pdmask.token_stats(z, b.rollout, sampling=pdmask.Sampling(eng.temperature))
    return st["topk_kl"][b.response_mask], st["log_ratio"][b.response_mask]


def test_fp32_no_mismatch_before_update_and_low_precision_mismatch(tiny_model, prompts):
    """fp32 at lag 0 agrees with the trainer up to float32 round-off (|log r| ~ 5e-7 here);
    every lower precision moves the sampled log-probs by orders of magnitude more."""
    kl, lr = {}, {}
    for prec in ("fp32", "bf16", "fp16", "fp8", "fp8-bf16"):
        eng = _engine(tiny_model, precision=prec)
        b = eng.generate(prompts, max_new_tokens=12, seed=5)
        kl[prec], lr[prec] = _mismatch(tiny_model, eng, b)
    assert kl["fp32"].max() < 1e-6 and lr["fp32"].abs().max() < 1e-5, (kl["fp32"].max(), lr["fp32"].abs().max())
    for prec in ("bf16", "fp16", "fp8", "fp8-bf16"):
        assert lr[prec].abs().max() > 1e-4, prec
        assert kl[prec].mean() > kl["fp32"].mean(), prec
    assert kl["fp8"].mean() > kl["bf16"].mean() > kl["fp16"].mean()  # 3 < 7 < 10 mantissa bits


@pytest.mark.usefixtures("one_thread")  # bitwise: the engine's two generations run the same ops, on one thread
def test_engine_owns_its_weights(tiny_model, prompts):
    import copy

    model = copy.deepcopy(tiny_model)
    eng = _engine(model)
    b0 = eng.generate(prompts, max_new_tokens=8, seed=2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    b1 = eng.generate(prompts, max_new_tokens=8, seed=2)
    assert torch.equal(b0.rollout.sampled_logprob, b1.rollout.sampled_logprob)  # trainer update does not leak in
    kl, _ = _mismatch(model, eng, b1)
    assert kl.mean() > 1e-5  # ... so the lag is real mismatch
    eng.load_weights(model.state_dict())
    kl, _ = _mismatch(model, eng, eng.generate(prompts, max_new_tokens=8, seed=2))
    assert kl.max() < 1e-6


def test_fp8_roundtrip_per_tensor_scale():
    w = torch.tensor([[0.5, -1.0], [0.001, 2.0]])
    q = fp8_roundtrip(w)
    s = 2.0 / E4M3_MAX  # amax / 448
    ref = (w / s).to(torch.float8_e4m3fn).float() * s
    assert torch.equal(q, ref)
    assert q[1, 1] == 2.0 and q[0, 1] == -1.0  # scaled to the grid: powers of two survive
    assert (q - w).abs().max() > 0  # 0.001 is not representable exactly
    with pytest.raises(ValueError, match="weights"):
        fp8_roundtrip(torch.tensor([1.0, float("nan")]))


def test_bad_arguments(tiny_model, prompts):
    with pytest.raises(ValueError, match="precision"):
        _engine(tiny_model, precision="int4")
    with pytest.raises(ValueError, match="temperature"):
        _engine(tiny_model, temperature=0.0)
    with pytest.raises(ValueError, match="engine"):
        make_engine("nope", tiny_model, eos_id=1, pad_id=0)
    with pytest.raises(ValueError, match="prompts"):
        _engine(tiny_model).generate([[]], max_new_tokens=3, seed=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        _engine(tiny_model).generate(prompts, max_new_tokens=0, seed=0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_shared_prefill_equals_the_plain_prefill(tiny_model, prompts, precision):
    """Groups of repeated prompts (as GRPO sends them), prompts of unequal length: one
    prefill per distinct prompt gives the same tokens and log-probs up to GEMM rounding."""
    groups = [p for p in prompts for _ in range(3)]  # (12,) rows, 4 distinct prompts
    plain = _engine(tiny_model, precision=precision)
    shared = _engine(tiny_model, precision=precision, share_prefill=True)
    a = plain.generate(groups, max_new_tokens=10, seed=5, return_logits=True)
    b = shared.generate(groups, max_new_tokens=10, seed=5, return_logits=True)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.response_mask, b.response_mask)
    tol = 1e-5 if precision == "fp32" else 2e-2
    m = a.response_mask
    torch.testing.assert_close(b.rollout.sampled_logprob[m], a.rollout.sampled_logprob[m], rtol=0, atol=tol)
    torch.testing.assert_close(b.rollout.topk_logprobs[m], a.rollout.topk_logprobs[m], rtol=0, atol=tol)
    torch.testing.assert_close(b.rollout.logits[m], a.rollout.logits[m], rtol=0, atol=tol * 10)
    # rows of one group differ after the prefill (each samples its own tokens)
    assert not all(torch.equal(b.sequences[0], b.sequences[i]) for i in (1, 2))


def test_shared_prefill_is_refused_outside_the_hf_engine():
    from types import SimpleNamespace

    from pdmask.engine.registry import build_engine

    from pdmask.ops import Sampling

    cfg = SimpleNamespace(engine="vllm", engine_share_prefill=True, engine_precision="fp32", top_k=5,
                          loss=SimpleNamespace(sampling=Sampling(temperature=1.0)))
    with pytest.raises(ValueError, match="^engine_share_prefill: built into the hf engine only"):
        build_engine(cfg, None, SimpleNamespace(eos_token_id=1, pad_token_id=0))
