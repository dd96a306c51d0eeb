"""The pdmask_vllm replica's pieces: output parsing on constructed vLLM outputs, the engine
handle that asks for logprobs=K, K/config checks, and the registration in verl."""

from __future__ import annotations

import asyncio
import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from verl_helpers import load_engine_fakes, needs_verl

from pdmask.integrations.verl.rollout import (
    EXTRA_KEYS, TopKEngine, check_max_logprobs, completion_topk_fields, topk_from_config,
)

_fakes = load_engine_fakes()
SamplingParams, vllm_sample = _fakes.SamplingParams, _fakes.vllm_sample


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("top_k", [0, 6])
def test_completion_fields_match_engine_distribution(flat, top_k):
    """Arrays the replica adds to extra_fields == top-K of the processed log-probs the fake
    engine sampled from (temperature 0.7, optional top-k truncation), sampled token by id."""
    V, K, T = 17, 5, 9
    logits = torch.randn(1, T, V, generator=torch.Generator().manual_seed(0)) * 3
    outs, ref = vllm_sample(logits, [T], k=K, temperature=0.7, top_k=top_k, flat=flat, seed=1)
    sp = SamplingParams(temperature=0.7, top_k=top_k, logprobs=K)
    f = completion_topk_fields(outs[0].outputs[0], k=K, logprobs_mode="processed_logprobs", sampling_params=sp)
    assert set(f) == set(EXTRA_KEYS)
    assert f["pdmask_topk_ids"].shape == (T, K) and f["pdmask_topk_ids"].dtype == np.int32
    assert f["pdmask_topk_logprobs"].dtype == np.float32 and f["pdmask_sampled_logprobs"].shape == (T,)
    lp = ref["logprobs"][0]  # (T, V) processed log-probs
    topv, topi = lp.topk(K, dim=-1)
    np.testing.assert_array_equal(f["pdmask_topk_ids"], topi.numpy())
    np.testing.assert_allclose(f["pdmask_topk_logprobs"], topv.numpy(), rtol=0, atol=0)
    np.testing.assert_array_equal(f["pdmask_sampled_ids"], ref["sampled_ids"][0].numpy())
    np.testing.assert_allclose(f["pdmask_sampled_logprobs"],
                               lp.gather(-1, ref["sampled_ids"][0][:, None]).squeeze(-1).numpy(), rtol=0, atol=0)


def test_sampled_outside_topk_keeps_its_own_logprob():
    V, K, T = 12, 2, 4
    logits = torch.linspace(3, -3, V).repeat(1, T, 1)
    outs, ref = vllm_sample(logits, [T], k=K, seed=0, force={(0, 1): V - 1})
    f = completion_topk_fields(outs[0].outputs[0], k=K, logprobs_mode="processed_logprobs")
    assert f["pdmask_sampled_ids"][1] == V - 1 and (V - 1) not in f["pdmask_topk_ids"][1]
    assert f["pdmask_sampled_logprobs"][1] == pytest.approx(float(ref["logprobs"][0, 1, V - 1]))


def test_raw_mode_with_temperature_warns_and_logits_mode_refused():
    from pdmask.formats.vllm import EngineSemanticsWarning

    logits = torch.randn(1, 3, 9, generator=torch.Generator().manual_seed(2))
    outs, _ = vllm_sample(logits, [3], k=3, temperature=0.5, mode="raw_logprobs")
    with pytest.warns(EngineSemanticsWarning):
        completion_topk_fields(outs[0].outputs[0], k=3, logprobs_mode="raw_logprobs",
                               sampling_params=SamplingParams(temperature=0.5))
    with pytest.raises(ValueError, match="logprobs_mode"):
        completion_topk_fields(outs[0].outputs[0], k=3, logprobs_mode="processed_logits")


class _FakeAsyncLLM:
    """AsyncLLM.generate's shape: an async generator of RequestOutputs (last one final)."""

    def __init__(self, outputs):
        self.outputs = outputs
        self.seen = []
        self.other = "forwarded"

    async def generate(self, prompt, sampling_params, request_id, **kw):
        self.seen.append(sampling_params.logprobs)
        for o in self.outputs:
            yield o


def test_topk_engine_requests_k_and_keeps_final_output():
    logits = torch.randn(1, 5, 10, generator=torch.Generator().manual_seed(3))
    outs, ref = vllm_sample(logits, [5], k=4, seed=3)
    partial = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[], logprobs=[])])
    fake = _FakeAsyncLLM([partial, outs[0]])
    eng = TopKEngine(fake, k=4)
    sp = SamplingParams(logprobs=0)  # what verl's server sets

    async def run():
        got = []
        async for o in eng.generate(prompt={"prompt_token_ids": [1]}, sampling_params=sp, request_id="r1"):
            got.append(o)
        return got

    got = asyncio.run(run())
    assert got == [partial, outs[0]] and fake.seen == [4] and sp.logprobs == 4
    assert eng.other == "forwarded"
    f = eng.pop_fields("r1", logprobs_mode="processed_logprobs")
    np.testing.assert_array_equal(f["pdmask_sampled_ids"], ref["sampled_ids"][0].numpy())
    assert eng.pop_fields("r1", logprobs_mode="processed_logprobs") == {}  # popped once
    aborted = TopKEngine(_FakeAsyncLLM([SimpleNamespace(outputs=[])]), k=4)

    async def run2():
        async for _ in aborted.generate({"prompt_token_ids": [1]}, SamplingParams(), "r2"):
            pass

    asyncio.run(run2())
    assert aborted.pop_fields("r2", logprobs_mode=None) == {}


def test_k_from_config_and_max_logprobs():
    assert topk_from_config(SimpleNamespace(custom=None)) == 20
    assert topk_from_config(SimpleNamespace(custom={"pdmask_topk": 8})) == 8
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="pdmask_topk"):
            topk_from_config(SimpleNamespace(custom={"pdmask_topk": bad}))
    kw = {}
    check_max_logprobs(kw, 20)
    assert kw == {}  # vLLM's default max_logprobs is 20
    check_max_logprobs(kw, 32)
    assert kw == {"max_logprobs": 32}
    check_max_logprobs({"max_logprobs": -1}, 64)
    with pytest.raises(ValueError, match="max_logprobs"):
        check_max_logprobs({"max_logprobs": 10}, 20)


@needs_verl
def test_replica_registered_in_verl():
    import verl  # noqa: F401
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    assert "pdmask_vllm" in RolloutReplicaRegistry._registry
    assert _ROLLOUT_REGISTRY[("pdmask_vllm", "async")] == _ROLLOUT_REGISTRY[("vllm", "async")]
    if importlib.util.find_spec("vllm") is None:
        # verl's vLLM server imports vllm at module level (verl.third_party.vllm raises
        # ValueError when it is missing); ours imports it through that module
        with pytest.raises((ImportError, ValueError), match="vllm"):
            RolloutReplicaRegistry.get("pdmask_vllm")
    else:  # pragma: no cover - GPU environments
        cls = RolloutReplicaRegistry.get("pdmask_vllm")
        assert cls.__name__ == "PdmaskVLLMReplica"
