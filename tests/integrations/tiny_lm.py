"""A tiny causal LM and tokenizer built locally (no downloads), for the TRL tests and
the example scripts. Vocabulary: specials + the letters a-p + a few words."""

from __future__ import annotations

import torch

WORDS = ["<pad>", "<eos>", "<bos>", "<unk>"] + list("abcdefghijklmnop") + ["say", "count", "repeat", ":"]


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")
    fast.padding_side = "left"
    return fast


def tiny_model(seed: int = 0, hidden: int = 32, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(WORDS), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    # Spread the output layer so the sampling distribution is far from uniform (top-K matters).
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    return model


def prompts(n: int = 8) -> list[str]:
    """Prompts of 2 to 6 tokens, so batches mix lengths and TRL left-pads them."""
    letters = list("abcdefghijklmnop")
    return [" ".join(["say"] + [letters[(3 * i + j) % 16] for j in range(i % 5)] + [":"]) for i in range(n)]


def reward_letter_a(completions, **kwargs) -> list[float]:
    """Share of 'a' tokens in the completion (a learnable, dense reward)."""
    out = []
    for c in completions:
        toks = c.split()
        out.append(sum(t == "a" for t in toks) / max(len(toks), 1))
    return out
