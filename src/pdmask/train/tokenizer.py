"""A byte-level BPE tokenizer trained locally on the task corpus (no download).

Special tokens: ``<pad>`` = 0, ``<eos>`` = 1. The result is wrapped as a
``PreTrainedTokenizerFast`` so it is saved next to the model with
``save_pretrained`` and the checkpoint directory is a normal Hugging Face model
directory (loadable with ``--model PATH``).
"""

from __future__ import annotations

PAD, EOS = "<pad>", "<eos>"


def train_bpe_tokenizer(texts: list[str], vocab_size: int):
    """Train a byte-level BPE of ``vocab_size`` entries (special tokens included) on ``texts``.

    Raises ValueError if the corpus cannot fill the vocabulary (BPE ran out of pairs).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise ValueError(f"vocab_size: must be >= 300 (256 bytes + specials + merges), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[PAD, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() < vocab_size:
        raise ValueError(f"vocab_size: the corpus only supports {tok.get_vocab_size()} BPE entries, "
                         f"asked for {vocab_size}; lower vocab_size or enlarge train_size")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS)


def prepare_tokenizer(tokenizer):
    """Make any HF tokenizer usable here: it needs an EOS token, and a pad token (EOS if none)."""
    if tokenizer.eos_token_id is None:
        raise ValueError("model_path: the tokenizer has no eos_token; set one in its tokenizer_config.json")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
