import pytest
import torch

pytest.importorskip("transformers", reason="engine tests need the 'train' extra (transformers)")


@pytest.fixture(scope="module")
def tiny_model():
    """A 2-layer Llama with V = 97 and an untied head, randomly initialised (seeded), float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)
    m = LlamaForCausalLM(cfg)
    # larger logits than the default init, so sampling distributions are not near-uniform
    with torch.no_grad():
        m.lm_head.weight.mul_(4.0)
    return m.eval()


@pytest.fixture
def prompts():
    return [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [2, 3, 4, 5, 6, 7, 8]]
