"""GRPO with a trust-region mask in TRL, end to end.

Runs as is on a CPU with a tiny model built in memory (no download):

    pip install -e ".[trl]"          # from a pdmask checkout (torch first on CPU)
    python examples/trl/train_grpo.py --mask-mode pdm-topk-kl --max-steps 4

Two processes (CPU: gloo; GPUs: NCCL):

    accelerate launch --multi_gpu --num_processes 2 examples/trl/train_grpo.py --max-steps 4
    torchrun --nproc_per_node 2 examples/trl/train_grpo.py --max-steps 4

A real model (a local path or a hub name your machine can load) with vLLM colocated on the
training GPUs -- not run in this repository's CI, which has no GPU:

    accelerate launch examples/trl/train_grpo.py --model Qwen/Qwen3-0.6B --use-vllm \
        --mask-mode pdm-topk-kl --rollout-top-k 20 --max-completion-length 512 --bf16

Note ``accelerate launch --num_processes 2 --cpu`` starts a single process; use
``--multi_gpu`` (it falls back to gloo without GPUs) or torchrun.
"""

from __future__ import annotations

import argparse

import torch
from datasets import Dataset

from pdmask.integrations.trl import GRPOConfig, GRPOTrainer, finish_and_exit

WORDS = ["<pad>", "<eos>", "<bos>", "<unk>"] + list("abcdefghijklmnop") + ["say", "count", "repeat", ":"]


def tiny_model_and_tokenizer(seed: int = 0):
    """A 2-layer Llama over a 24-word vocabulary, built locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                        bos_token="<bos>", unk_token="<unk>", padding_side="left")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # a peaked distribution, so top-K matters
    return model, tokenizer


def reward_letter_a(completions, **kwargs):
    """Share of the token 'a' in each completion."""
    return [sum(t == "a" for t in c.split()) / max(len(c.split()), 1) for c in completions]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path/name (default: a tiny model built in memory)")
    p.add_argument("--mask-mode", default="pdm-topk-kl")
    p.add_argument("--mask-estimator", default="exact")
    p.add_argument("--mask-delta", type=float, default=None, help="delta_low = delta_high (default: the mode's)")
    p.add_argument("--rollout-top-k", type=int, default=20)
    p.add_argument("--is-cap", type=float, default=5.0)
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=8)
    p.add_argument("--per-device-batch", type=int, default=4)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--steps-per-generation", type=int, default=2)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--learning-rate", type=float, default=None)
    p.add_argument("--use-vllm", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--output-dir", default="out/trl-grpo")
    a = p.parse_args(argv)

    if a.model is None:
        model, tokenizer = tiny_model_and_tokenizer()
        k = min(a.rollout_top_k, len(WORDS))
        prompts = [f"say {x} {y} :" for x, y in zip("abcdefghijklmnop", "ponmlkjihgfedcba")]
        lr = a.learning_rate or 1e-2
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16 if a.bf16 else None)
        tokenizer = AutoTokenizer.from_pretrained(a.model)
        k = a.rollout_top_k
        prompts = [f"Write the letter a {n} times:" for n in range(1, 65)]
        lr = a.learning_rate or 1e-6

    args = GRPOConfig(
        output_dir=a.output_dir, max_steps=a.max_steps, learning_rate=lr, logging_steps=1, save_strategy="no",
        report_to="none", per_device_train_batch_size=a.per_device_batch, num_generations=a.num_generations,
        steps_per_generation=a.steps_per_generation, max_completion_length=a.max_completion_length,
        temperature=a.temperature, loss_type=a.loss_type, bf16=a.bf16, use_cpu=not torch.cuda.is_available(),
        use_vllm=a.use_vllm, vllm_mode="colocate",
        # the IS weight against the vLLM sampler mu: --is-cap's min(pi/mu, is_cap). Leaving TRL's
        # correction on (its default) would use TRL's mode instead (sequence_mask, clip_max=3), and
        # the config refuses is_cap next to it
        vllm_importance_sampling_correction=False,
        # the trust-region mask
        mask_mode=a.mask_mode, mask_estimator=a.mask_estimator, mask_delta_low=a.mask_delta,
        mask_delta_high=a.mask_delta, rollout_top_k=k, is_cap=a.is_cap,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward_letter_a, args=args,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer)
    trainer.train()
    if trainer.accelerator.is_main_process:
        for h in trainer.state.log_history:
            if "pdmask/kept_frac" in h:  # reward is logged on generation steps only
                reward = f"{h['reward']:.3f}" if "reward" in h else "-"
                print(f"step {h.get('step')}: loss {h['loss']:.4f} reward {reward} "
                      f"kept {h['pdmask/kept_frac']:.3f} out_of_region {h['pdmask/out_of_region_frac']:.3f} "
                      f"disagreement {h['pdmask/disagreement_frac']:.3f}")
    return trainer


if __name__ == "__main__":
    # Under accelerate/torchrun: wait for every rank, destroy the process group and leave with
    # os._exit -- the gloo process group's destructor can deadlock at interpreter exit (see
    # pdmask.integrations.trl.shutdown). A single process just returns.
    finish_and_exit(main())
