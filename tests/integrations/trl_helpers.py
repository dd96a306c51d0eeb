"""Shared pieces of the TRL tests: a probing trainer that re-derives every loss
independently, a vLLM-shaped fake generator, and the trainer factory."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from datasets import Dataset

# engine_fakes.py lives with the converter tests (tests/formats), which share it; the repository
# root makes tests.flat importable in the torchrun workers too
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine_fakes import RequestOutput, CompletionOutput, append_position, trl_extract  # noqa: E402
from tiny_lm import prompts, reward_letter_a, tiny_model, tiny_tokenizer  # noqa: E402

import pdmask  # noqa: E402
from pdmask.integrations.trl import GRPOConfig, GRPOTrainer, options  # noqa: E402
from tests import flat  # noqa: E402


def hand_aggregate(token_loss, mask, trainer, inputs, mode="train"):
    """TRL 1.16's normalisation of each loss_type, written out (grpo_trainer._compute_loss)."""
    m = mask.float()
    x = token_loss * m
    ga = trainer.current_gradient_accumulation_steps if mode == "train" else 1
    lt = trainer.loss_type
    if lt == "dapo":
        n = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        n = n * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
        return x.sum() / n
    if lt == "bnpo":
        return x.sum() / m.sum().clamp(min=1.0) / ga
    if lt == "grpo":
        return (x.sum(-1) / m.sum(-1).clamp(min=1.0)).mean() / ga
    if lt == "dr_grpo":
        return x.sum() / (x.shape[0] * trainer.max_completion_length) / ga
    raise AssertionError(lt)



def loss_kwargs(args) -> dict:
    """The loss settings the config maps to, in the flat spelling of :mod:`tests.flat`:
    the corrections' fields (``is_cap`` None when not given), the grpo clip range and dual clip
    of ``options.loss_spec``."""
    from pdmask.corrections import FIELDS

    spec = options.loss_spec(args)
    kw = {name: getattr(spec.corrections, name) for name in FIELDS}
    if not spec.corrections.is_cap_given:
        kw["is_cap"] = None
    kw.update(eps_low=spec.thresholds.eps_low, eps_high=spec.thresholds.eps_high, dual_clip=spec.thresholds.dual_clip)
    return kw


def sampling_kwargs(args) -> dict:
    """The generator's truncation as the flat ``sampling_*`` keywords."""
    s = options.sampling(args)
    return {"sampling_top_k": s.top_k, "sampling_top_p": s.top_p, "sampling_min_p": s.min_p}

class Probe(GRPOTrainer):
    """Checks every micro-batch against an independent computation."""

    def __init__(self, *a, **kw):
        self.records = []
        super().__init__(*a, **kw)

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        a = self.args
        with torch.no_grad():
            P = inputs["prompt_ids"].shape[1]
            comp = inputs["completion_ids"]
            ids = torch.cat([inputs["prompt_ids"], comp], 1)
            am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            pos = (am.long().cumsum(-1) - 1).clamp(min=0)  # positions as generate() counts them
            moe = self.aux_loss_enabled
            extra = {"output_router_logits": True} if moe else {}
            out = model(input_ids=ids, attention_mask=am, position_ids=pos, **extra)
            logits = out.logits[:, P - 1:-1].float()
            mask = inputs["completion_mask"].bool()
            # TRL's two-sided clip `delta` is the grpo dual clip (see test_trl_options); the
            # corrections and the truncation as mapped by options (their mapping: test_trl_corrections)
            dual = a.delta if (a.mask_mode == "grpo" and a.delta is not None) else None
            corr = {k: v for k, v in loss_kwargs(a).items() if k not in ("eps_low", "eps_high", "dual_clip")}
            ref = flat.policy_loss(
                logits, comp, inputs["sampled_logprob"], inputs.get("topk_ids"),
                inputs.get("topk_logprobs"), inputs["advantages"], mask, mode=a.mask_mode,
                estimator=a.mask_estimator, delta_low=a.mask_delta_low, delta_high=a.mask_delta_high,
                eps_low=a.epsilon, eps_high=a.epsilon_high or a.epsilon, dual_clip=dual,
                temperature=a.temperature, **corr, **sampling_kwargs(a))
            expected = hand_aggregate(ref.token_loss, mask, self, inputs)
            kl = None
            if self.beta != 0.0:  # TRL's k3 term (grpo_trainer._compute_loss), from independent forwards
                ref_logits = self.ref_model(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, P - 1:-1]
                T = a.temperature
                lp = torch.log_softmax(logits / T, -1).gather(-1, comp[..., None]).squeeze(-1)
                ref_lp = torch.log_softmax(ref_logits.float() / T, -1).gather(-1, comp[..., None]).squeeze(-1)
                kl = torch.exp(ref_lp - lp) - (ref_lp - lp) - 1
                if a.use_bias_correction_kl:
                    kl = kl * torch.exp(lp - inputs["sampled_logprob"])
                expected = expected + hand_aggregate(self.beta * kl, mask, self, inputs)
            if moe:  # TRL adds coef x aux / GA (grpo_trainer._compute_loss)
                ga = self.current_gradient_accumulation_steps
                expected = expected + self.router_aux_loss_coef * out.aux_loss / ga
        self.records.append({
            "loss": loss.detach().clone(), "expected": expected, "logits": logits, "mask": mask,
            # no optimizer step since this batch was generated (generation is aligned to steps)
            "on_policy": self._step % (a.steps_per_generation * a.num_iterations) < a.gradient_accumulation_steps,
            "inputs": {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)},
            "kept": ref.mask, "metrics": ref.metrics, "entropy": ref.stats["entropy"], "kl": kl,
        })
        return loss


def config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                max_completion_length=6, max_steps=2, steps_per_generation=2, logging_steps=1,
                save_strategy="no", report_to="none", learning_rate=3e-2, temperature=0.8, rollout_top_k=4,
                disable_tqdm=True, seed=0)
    base.update(kw)
    return GRPOConfig(**base)


def make_trainer(tmp_path, cls=Probe, n_prompts=8, model=None, **kw):
    return cls(model=model if model is not None else tiny_model(), reward_funcs=reward_letter_a,
               args=config(tmp_path, **kw), train_dataset=Dataset.from_dict({"prompt": prompts(n_prompts)}),
               processing_class=tiny_tokenizer())


class FakeVLLMGeneration:
    """Stands in for ``trl.generation.VLLMGeneration`` (colocate, processed_logprobs).

    Samples token by token from the trainer's model, fills vLLM-shaped ``Logprob`` dicts
    (sampled token first with its count-rank, then ranks 1..K: K or K + 1 entries) and
    returns TRL's rank-sorted lists, exactly the 4-tuple ``VLLMGeneration.generate`` returns.
    """

    def __init__(self, trainer, logprobs=0):
        self.trainer = trainer
        self.logprobs = logprobs
        self.synced = 0
        self.outputs = None

    def sync_weights(self):
        self.synced += 1

    @torch.no_grad()
    def generate(self, prompts, images, num_generations, profiler=None):
        tr = self.trainer
        model = tr.accelerator.unwrap_model(tr.model)
        T, K, eos = tr.temperature, self.logprobs, 1
        outs = []
        for p in prompts:
            seq = list(p)
            container, comp = [], []
            for _ in range(tr.max_completion_length):
                z = model(input_ids=torch.tensor([seq])).logits[0, -1].float()
                lp = torch.log_softmax(z / T, -1)
                s = int(torch.multinomial(lp.exp(), 1))
                topv, topi = lp.topk(K) if K else (torch.zeros(0), torch.zeros(0, dtype=torch.long))
                rank = int((lp >= lp[s]).sum())
                append_position(container, [s] + topi.tolist(), [float(lp[s])] + topv.tolist(), rank, K)
                comp.append(s)
                seq.append(s)
                if s == eos:
                    break
            outs.append(RequestOutput("r", list(p), [CompletionOutput(0, "", comp, None, container)]))
        self.outputs = outs
        lps, lp_ids = trl_extract(outs)
        return [list(p) for p in prompts], [o.outputs[0].token_ids for o in outs], lps, lp_ids
