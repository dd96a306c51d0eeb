"""``GRPOTrainer`` whose policy loss is :func:`pdmask.policy_loss` with a trust-region mask.

Three private TRL 1.16 methods are overridden, each as thinly as possible:

- ``_generate_single_turn``: capture mu. On the vLLM path, ask vLLM for ``logprobs=K``
  and convert TRL's rank-sorted lists with
  :func:`pdmask.formats.vllm.from_ranked_lists` -- which picks the *sampled*
  token's log-prob by id (TRL keeps ``lp[0]``, the rank-1 token's). On the
  ``transformers`` path, attach a :class:`TopKRecorder` to ``generate``. The base
  method still does the generating; the captured tensors wait in ``self._pdmask_rollout``.
- ``_generate_and_score_completions``: add ``sampled_logprob`` (B, T) and
  ``topk_ids`` / ``topk_logprobs`` (B, T, K) to the batch dict; TRL's
  ``shuffle_sequence_dict`` / ``split_tensor_dict`` permute and slice every tensor along
  dim 0, so they stay aligned with the completions through shuffling and micro-batching.
- ``_compute_loss``: a forward that returns logits, then :func:`pdmask.policy_loss`,
  aggregated as TRL's ``loss_type`` would, plus TRL's KL term to the reference model when
  ``beta != 0``, and the metrics logged under ``pdmask/``.

Two more, smaller: ``_get_per_token_logps_and_entropies`` (TRL's scoring forward, used
here for the reference model's log-probs) gets position ids counted as the loss counts
them, and TRL's old-log-prob forward, which nothing here reads, is skipped
(:meth:`PDMaskGRPOTrainer._without_old_logps`).

Why a logits forward: TRL 1.16 scores completions with a fused LM head
(``add_fused_lm_head``) that returns ``log pi_k`` and the entropy without ever building
the (B, T, V) logits. The predictive mask also needs ``pi`` at the rollout's top-K ids
and ``sum_i pi_i^2``, which that head does not produce, so the loss calls the model's
ordinary forward (``fused_lm_head`` off, ``logits_to_keep = T + 1``). The cost is TRL's
pre-1.x memory profile: one (B, T, V) logits tensor per micro-batch in the model's
dtype; the core library's reductions and backward are chunked and never add a float32
(B, T, V) copy. ``loss_from_hidden=True`` removes it: :func:`pdmask.policy_loss_from_hidden`
runs inside the model's (wrapped) forward on the backbone's last hidden states and
``lm_head.weight`` (:mod:`.hidden`, which also refuses heads that are not ``hidden @ W.T``).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from fractions import Fraction

import torch
from trl import GRPOTrainer as _TRLGRPOTrainer

from ..._validate import SpecError
from ...anchor import Anchor
from ...loss import Aggregation, aggregate
from ...ops import Hidden
from ...rollout import Rollout
from ...formats.vllm import check_sampling_semantics, from_ranked_lists
from . import binding as _binding
from . import hidden as _hidden
from . import old_policy as _old_policy
from . import options
from .capture import TopKRecorder
from .config import PDMaskGRPOConfig

_COUNT_METRICS = ("num_out_of_region", "num_disagreement", "num_tokens")


def _pad_time(t: torch.Tensor | None, T: int, fill) -> torch.Tensor | None:
    """Cut or pad dim 1 to length T."""
    if t is None:
        return None
    if t.shape[1] >= T:
        return t[:, :T]
    pad = t.new_full((t.shape[0], T - t.shape[1]) + tuple(t.shape[2:]), fill)
    return torch.cat([t, pad], 1)


class PDMaskGRPOTrainer(_TRLGRPOTrainer):
    """TRL's ``GRPOTrainer`` with a trust-region-masked policy loss (see the module docstring).

    Takes the same arguments as ``trl.GRPOTrainer``; ``args`` must be a
    :class:`PDMaskGRPOConfig`. Multi-turn tool calling, environments and custom
    ``rollout_func`` are not supported (they generate outside the captured path).
    """

    def __init__(self, *args_, **kwargs):
        a = kwargs.get("args", args_[2] if len(args_) > 2 else None)
        if not isinstance(a, PDMaskGRPOConfig):
            raise ValueError("args: pass a pdmask.integrations.trl.GRPOConfig (PDMaskGRPOConfig), got "
                             f"{type(a).__name__}")
        for name in ("tools", "environment_factory", "rollout_func"):
            if kwargs.get(name) is not None:
                raise ValueError(f"{name}: not supported by the pdmask trainer (its generations are not captured)")
        self._pdmask_rollout: Rollout | None = None
        self._pdmask_old_pending: dict | None = None  # anchor="old": the old-log-prob forward's top-K (old_policy)
        self._pdmask_region_warned = False  # the once-per-run out-of-region-before-any-update warning
        # the config's one loss spec, built once (as GRPOTrainer reads its sampling settings once)
        self._pdmask_loss = options.loss_spec(a)
        super().__init__(*args_, **kwargs)
        vocab = getattr(self.model.config.get_text_config(), "vocab_size", None)
        if vocab is not None and a.rollout_top_k > vocab:
            raise ValueError(f"rollout_top_k: K={a.rollout_top_k} exceeds the model's vocabulary size {vocab}; "
                             f"set rollout_top_k <= {vocab}")
        self._pdmask_vocab = self.accelerator.unwrap_model(self.model).get_output_embeddings().weight.shape[0]
        if a.loss_from_hidden:  # after TRL's own patches (cast_lm_head_to_fp32, the fused head)
            _hidden.check_head(self.model, cast_lm_head_to_fp32=a.cast_lm_head_to_fp32,
                               aux_loss_enabled=self.aux_loss_enabled)
            _hidden.install(self.model, cast_lm_head_to_fp32=a.cast_lm_head_to_fp32)
        if self.use_vllm:
            self.vllm_generation.logprobs = a.rollout_top_k
            if self.vllm_mode == "server" and self.accelerator.is_main_process:
                info = self.vllm_generation.vllm_client.get_server_info()
                check_sampling_semantics(
                    logprobs_mode=info["model_config"]["logprobs_mode"], temperature=self.temperature,
                    top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                    repetition_penalty=self.repetition_penalty)

    # ------------------------------------------------------------ capture
    @contextmanager
    def _recording(self):
        """Attach a TopKRecorder to the unwrapped model's ``generate`` for one call."""
        model = self.accelerator.unwrap_model(self.model_wrapped)
        rec = TopKRecorder(self.args.rollout_top_k, self.generation_config)
        orig = model.generate

        def generate(*a, **kw):
            kw["logits_processor"] = list(kw.get("logits_processor") or []) + [rec]
            return orig(*a, **kw)

        model.generate = generate  # instance attribute: shadows the method for this call only
        try:
            yield rec
        finally:
            del model.generate

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        K = self.args.rollout_top_k
        if self.use_vllm:
            # TRL's own vLLM branch, keeping the top-K lists it discards
            if self.state.global_step != self._last_loaded_step:
                self.vllm_generation.sync_weights()
                self._last_loaded_step = self.state.global_step
            _, completion_ids, lps, lp_ids = self.vllm_generation.generate(
                prompts=prompt_ids, images=images, num_generations=num_generations)
            if lps is None:
                raise RuntimeError("vLLM returned no log-probs; the pdmask trainer needs them")
            r = from_ranked_lists(lps, lp_ids, completion_ids, k=K)
        else:
            with self._recording() as rec:
                completion_ids, _ = super()._generate_single_turn(
                    prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
            r = rec.finish(completion_ids)
        self._pdmask_rollout = r
        sampled = [r.sampled_logprob[b, : len(c)].tolist() for b, c in enumerate(completion_ids)]
        return completion_ids, sampled

    #: skip TRL's old-log-prob forward (:meth:`_without_old_logps`); False only to measure it
    #: side by side (examples/trl/bench_old_logps.py)
    _pdmask_skip_old_logps = True

    @contextmanager
    def _without_old_logps(self):
        """TRL's ``_generate_and_score_completions`` runs one no-grad forward over the whole
        generation batch for ``old_per_token_logps`` when ``gradient_accumulation_steps %
        (steps_per_generation * num_iterations) != 0`` (e.g. ``num_iterations > 1``) or when its
        vLLM IS correction is on. Nothing here reads them: the ratio's anchor is the rollout's
        mu, and the vLLM correction is pdmask's (:mod:`.options`, from ``args``). For the
        duration of the call both conditions are made false: ``num_iterations`` becomes the
        fraction GA / steps_per_generation (so the modulo is exactly 0; the attribute is read
        nowhere else in that method) and TRL's ``vllm_importance_sampling_correction``
        attribute False (TRL then skips its own IS weights and their ``sampling/*`` metrics,
        which need the old log-probs). Both are restored after the call. With ``anchor="old"``
        only the latter: TRL's old-log-prob forward then runs, answered by
        :func:`.old_policy.old_logprobs` (:meth:`_get_per_token_logps_and_entropies`)."""
        anchored = self._pdmask_loss.anchored  # anchor="old": TRL's forward is the anchor's (old_policy.py)
        if not (self._pdmask_skip_old_logps or anchored):
            yield
            return
        saved = self.num_iterations, self.vllm_importance_sampling_correction
        if not anchored:
            self.num_iterations = Fraction(self.args.gradient_accumulation_steps, self.args.steps_per_generation)
        self.vllm_importance_sampling_correction = False
        try:
            yield
        finally:
            self.num_iterations, self.vllm_importance_sampling_correction = saved

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, *args, **kwargs):
        """TRL's scoring forward (here: the reference model's log-probs when ``beta != 0``) with
        position ids counted from each row's first real token, as generate(), vLLM and the loss
        count them (:meth:`_forward_inputs`). TRL passes none, so on a left-padded row its
        reference log-probs would differ from the loss's pi at the same weights and the KL
        term would not be 0 where the two models agree. With ``anchor="old"`` the first call of a
        generation batch on the policy itself is TRL's old-log-prob forward: answered by
        :func:`.old_policy.old_logprobs` (pi_old at the sampled and the generator's top-K ids)."""
        pending = self._pdmask_old_pending
        if pending is not None and model is self.model and not pending:
            return self._old_policy_forward(model, input_ids, attention_mask, *args, **kwargs)
        return super()._get_per_token_logps_and_entropies(_WithPositions(model), input_ids, attention_mask,
                                                          *args, **kwargs)

    def _old_policy_forward(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                            compute_entropy=False, compute_aux_loss=False, **mm):
        """TRL's old-log-prob forward, as :func:`.old_policy.old_logprobs`: its log-probs at the
        sampled ids go back to TRL (``old_per_token_logps``), those at the top-K ids wait in
        ``_pdmask_old_pending`` for :meth:`_generate_and_score_completions`."""
        given = [k for k, v in mm.items() if v is not None and k in _old_policy.MULTIMODAL]
        if given or compute_entropy or compute_aux_loss:
            raise ValueError(f"anchor: 'old' scores text-only batches (TRL's old-log-prob forward was asked for "
                             f"{', '.join(given) or 'entropies or the MoE aux loss'}); use anchor='rollout'")
        r = self._pdmask_rollout
        tk = None if r is None or r.topk_ids is None else _pad_time(r.topk_ids.to(input_ids.device), logits_to_keep, 0)
        lp, topk = _old_policy.old_logprobs(self, model, input_ids, attention_mask, logits_to_keep, batch_size, tk)
        self._pdmask_old_pending["topk"] = topk
        return lp, None, None

    def _generate_and_score_completions(self, inputs):
        self._pdmask_rollout = None
        self._pdmask_old_pending = {} if self._pdmask_loss.anchored else None
        try:
            with self._without_old_logps():
                out = super()._generate_and_score_completions(inputs)
            old = self._pdmask_old_pending
        finally:
            self._pdmask_old_pending = None
        r = self._pdmask_rollout
        if r is None:
            raise RuntimeError("pdmask: no rollout was captured for this batch (custom generation path?)")
        self._pdmask_rollout = None
        comp = out["completion_ids"]
        B, T = comp.shape
        if r.sampled_ids.shape[0] != B:
            raise RuntimeError(f"pdmask: captured {r.sampled_ids.shape[0]} rollouts for {B} completions")
        dev = comp.device
        ids = _pad_time(r.sampled_ids.to(dev), T, 0)
        mask = _pad_time(r.response_mask.to(dev), T, False)
        comp_mask = out["completion_mask"].bool()
        if bool(((ids != comp) & mask & comp_mask).any()):
            raise RuntimeError("pdmask: captured sampled ids differ from TRL's completion ids")
        # TRL shuffles and splits the inputs dict by key: the rollout travels as its tensors,
        # under its own field names, and is put back together in _compute_loss
        out["sampled_logprob"] = _pad_time(r.sampled_logprob.to(dev, torch.float32), T, 0.0)
        if r.topk_ids is not None:
            out["topk_ids"] = _pad_time(r.topk_ids.to(dev), T, 0)
            out["topk_logprobs"] = _pad_time(r.topk_logprobs.to(dev, torch.float32), T, float("-inf"))
        if old is not None:  # anchor="old": pi_old's log-probs travel with the batch as TRL's own do
            if "old_per_token_logps" not in out or "topk" not in old:
                raise RuntimeError("pdmask: anchor='old' but TRL ran no old-log-prob forward for this batch")
            if old["topk"] is not None:
                out["old_topk_logprobs"] = old["topk"].to(dev)
        return out

    # ------------------------------------------------------------ loss
    def _aggregation(self, mode: str, B: int, inputs) -> tuple[Aggregation, float]:
        """The :class:`pdmask.Aggregation` and the divisor reproducing TRL's ``loss_type``."""
        ga = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        lt = self.loss_type
        if lt in ("dapo", "cispo"):  # TRL normalises cispo as dapo (grpo_trainer.py:3168)
            n = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                n = n * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            return Aggregation("token-mean", num_tokens=n), 1.0
        if lt == "bnpo":
            return Aggregation("token-mean"), ga
        if lt == "grpo":
            return Aggregation("seq-mean-token-mean", num_seqs=B), ga
        if lt == "dr_grpo":
            return Aggregation("seq-mean-token-sum-norm", num_seqs=B, loss_scale_factor=self.max_completion_length), ga
        raise ValueError(f"loss_type: {lt!r} is not supported by the pdmask trainer")

    @staticmethod
    def _forward_inputs(inputs) -> dict:
        """input_ids, attention_mask, position_ids of prompt + completion."""
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        # Positions count from each row's first real token, as generate() and vLLM count them.
        # Without them the left padding shifts every position of a short prompt: RoPE is
        # shift-invariant only up to float rounding (a measurable mismatch, up to 1e-2 in
        # log-probs on the test model) and absolute position embeddings are simply wrong.
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}

    def _completion_logits(self, model, inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T, V) logits predicting the completion tokens (ordinary forward, not the fused head), and
        the MoE load-balancing loss when TRL would add it (``aux_loss_enabled``), else None."""
        T = inputs["completion_ids"].shape[1]
        extra = {"output_router_logits": True} if self.aux_loss_enabled else {}
        with self.accelerator.autocast():
            out = model(**self._forward_inputs(inputs), logits_to_keep=T + 1, use_cache=False, **extra)
        aux = out.aux_loss if self.aux_loss_enabled else None
        return out.logits[:, -(T + 1):-1, :], aux  # position P-1+t predicts completion token t

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        a = self.args
        if "pixel_values" in inputs:
            raise ValueError("inputs: multimodal (pixel_values) batches are not supported by the pdmask trainer")
        comp = inputs["completion_ids"]
        mask = inputs["completion_mask"].bool()
        if "tool_mask" in inputs:
            mask = mask & inputs["tool_mask"].bool()
        agg, divisor = self._aggregation(mode, comp.shape[0], inputs)
        rollout = Rollout(comp, inputs["sampled_logprob"], inputs.get("topk_ids"), inputs.get("topk_logprobs"), mask)
        adv, loss_fn = inputs["advantages"], self._pdmask_loss
        anchor = None if not loss_fn.anchored else \
            Anchor(inputs["old_per_token_logps"].float(), inputs.get("old_topk_logprobs"))
        if a.loss_from_hidden:
            T = comp.shape[1]

            def from_hidden(hidden, weight):  # runs inside the model's forward (hidden.py)
                h = hidden[:, -(T + 1):-1, :]  # (B, T, H): position P-1+t predicts completion token t
                return loss_fn(Hidden(h, weight.to(h.dtype)), rollout, adv, aggregation=agg, anchor=anchor)

            with self.accelerator.autocast():
                res = self._nonfinite_named(model, **self._forward_inputs(inputs), pdmask_hidden_loss=from_hidden)
            aux_loss = None  # refused at init (hidden.check_head)
        else:
            logits, aux_loss = self._completion_logits(model, inputs)
            res = self._nonfinite_named(loss_fn, logits, rollout, adv, aggregation=agg, anchor=anchor)
        self._log_pdmask_metrics(mode, res, mask, inputs["advantages"], rollout, anchor)
        loss = res.loss / divisor
        if self.beta != 0.0:
            loss = loss + self._kl_term(mode, res.stats["logp"], inputs, mask, agg) / divisor
        if aux_loss is not None:  # as TRL adds the MoE router loss: coef x aux / GA
            loss = loss + self.router_aux_loss_coef * aux_loss / (
                self.current_gradient_accumulation_steps if mode == "train" else 1.0)
            aux = self.accelerator.gather_for_metrics(aux_loss.detach()).mean().item()
            self._metrics[mode]["aux_loss"].append(aux)
        self._check_finite(loss)
        return loss

    def _step_advice(self) -> tuple[str, str]:
        """The step being computed (1-based, as the logs count optimizer steps) and what to change."""
        return f"step {self.state.global_step + 1}", f"lower learning_rate (now {self.args.learning_rate:g})"

    def _check_finite(self, loss: torch.Tensor) -> None:
        """Stop at the first non-finite loss, naming the step: the host trainer's NaN filtering
        is not relied on (transformers logs a NaN loss as 0 and steps on; the next step fails
        far from the cause). One host sync per micro-batch, as the metrics' own."""
        if bool(torch.isfinite(loss.detach()).all()):
            return
        step, tip = self._step_advice()
        raise FloatingPointError(f"{step}: the pdmask loss is {float(loss.detach()):g} (non-finite): the weights went "
                                 f"non-finite at an earlier update, or the loss overflowed: {tip}")

    def _nonfinite_named(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, a refusal of non-finite logits (the loss's input check, after
        weights went non-finite) re-raised naming the step and what to change."""
        try:
            return fn(*args, **kwargs)
        except SpecError as e:
            if e.field not in ("logits", "hidden", "lm_head_weight"):
                raise
            step, tip = self._step_advice()
            raise FloatingPointError(f"{step}: the model's {e.field} is non-finite ({e.problem}): the weights went "
                                     f"non-finite at an earlier update: {tip}") from None

    def _kl_term(self, mode: str, logp: torch.Tensor, inputs, mask: torch.Tensor, agg: Aggregation) -> torch.Tensor:
        """TRL's KL penalty to the reference model, as TRL 1.16 adds it (``_compute_loss``)::

            kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1          (k3, per token)
            kl_t = kl_t * exp(logp_t - log mu_t)                        (use_bias_correction_kl)
            loss += aggregate(beta * kl, response mask) / divisor       (as the policy term)

        ``logp`` is the loss's ``log pi`` of the sampled token (``softmax(logits / T)``, with its
        gradient; the config refuses ``beta`` with truncated sampling, where it would be
        renormalised). Every response token counts, masked ones included, as in TRL (its KL is
        added after the policy term's masks). The bias correction's ratio is anchored where the
        region is: on mu (TRL's on ``old_per_token_logps``, the same on the first pass over a
        batch), on TRL's ``old_per_token_logps`` with ``anchor="old"``, as TRL. Logged as TRL's ``kl`` (token mean over all processes)."""
        ref = inputs["ref_per_token_logps"].to(logp.dtype)
        d = ref - logp
        kl = torch.exp(d) - d - 1
        if self.args.use_bias_correction_kl:  # pi over the region's centre: mu, or TRL's pi_old (anchor="old")
            centre = inputs["old_per_token_logps"] if self._pdmask_loss.anchored else inputs["sampled_logprob"]
            kl = kl * torch.exp(logp - centre.to(logp.dtype))
        kl = torch.where(mask, kl, torch.zeros_like(kl))
        totals = self.accelerator.reduce(torch.stack([kl.detach().sum(), mask.sum().to(kl.dtype)]), reduction="sum")
        self._metrics[mode]["kl"].append((totals[0] / totals[1].clamp(min=1.0)).item())
        return aggregate(self.beta * kl, mask, agg, validate=False)

    def _log_binding(self, res, valid: torch.Tensor, advantages: torch.Tensor, rollout: Rollout,
                     anchor: Anchor | None) -> None:
        """Where the region binds (:mod:`.binding`), training micro-steps only: by update index,
        by the sign of A, and at the start of each generation batch. One gather over processes."""
        a = self.args
        u = _binding.update_index(self._step, a.gradient_accumulation_steps, a.steps_per_generation,
                                  a.num_iterations)
        sums, means = _binding.local_values(res, valid, advantages, self._pdmask_loss, rollout, anchor, u == 1,
                                            self._pdmask_vocab)
        names = list(sums) + list(means)
        local = torch.stack([t.detach().float().reshape(()) for t in [*sums.values(), *means.values()]])
        allv = self.accelerator.gather(local.to(self.accelerator.device)[None]).reshape(-1, len(names))
        tot, avg = allv.sum(0).tolist(), allv.mean(0).tolist()
        avg_means = {k: avg[len(sums) + i] for i, k in enumerate(means)}
        out = _binding.metrics(u, {k: tot[i] for i, k in enumerate(sums)}, avg_means)
        for k, v in out.items():
            self._metrics["train"][f"pdmask/{k}"].append(v)
        self._warn_region(out, avg_means)

    def _warn_region(self, out: dict[str, float], means: dict[str, float]) -> None:
        """Once per run, on the main process: more than ``pdmask.anchor.WARN_OUT_BEFORE_UPDATE``
        of the tokens out of region before any update (:func:`.binding.region_warning`; the
        numbers are the gathered ones, already on the host)."""
        if self._pdmask_region_warned or not self.accelerator.is_main_process:
            return
        msg = _binding.region_warning(out, means, self._pdmask_loss)
        if msg is not None:
            self._pdmask_region_warned = True
            warnings.warn(f"pdmask: {self._step_advice()[0]}: {msg}", UserWarning, stacklevel=2)

    def _log_pdmask_metrics(self, mode: str, res, mask: torch.Tensor, advantages: torch.Tensor,
                            rollout: Rollout | None = None, anchor: Anchor | None = None) -> None:
        """pdmask's metrics under ``pdmask/`` (counts summed over processes, the rest averaged), and
        TRL's own ``entropy`` and ``clip_ratio/*`` keys with the same reductions TRL uses
        (token-weighted over all processes; min / max over the gathered per-sequence values).

        ``entropy``: of pi = softmax(logits / T), as TRL's. ``clip_ratio/*``: the tokens the
        objective zeroes (the mask, and in grpo mode also the dual clip), split by the sign
        of A as TRL splits its clipped tokens: ``low`` = A < 0, ``high`` = A > 0,
        ``region`` = both. In grpo mode ``high`` is TRL's definition with r = pi/mu; ``low``
        also counts the dual-clipped tokens, which TRL's does not (docs/trl.md).
        """
        m = res.metrics
        names = sorted(m)
        valid = mask.bool()
        adv = advantages[:, None].expand_as(valid) if advantages.dim() == 1 else advantages
        cut = ~res.mask & valid
        low, high = cut & (adv < 0), cut & (adv > 0)
        ent = torch.where(valid, res.stats["entropy"].detach().float(), torch.zeros_like(valid, dtype=torch.float32))
        sums = torch.stack([ent.sum(), low.sum().float(), high.sum().float(), cut.sum().float(),
                            valid.sum().float()])
        local = torch.cat([torch.stack([m[n].float() for n in names]), sums.to(ent.device)])
        local = local.to(self.accelerator.device)
        allv = self.accelerator.gather(local[None]).reshape(-1, local.shape[0])  # (world, M + 5)
        summed, mean = allv.sum(0).tolist(), allv.mean(0).tolist()
        for i, n in enumerate(names):
            self._metrics[mode][f"pdmask/{n}"].append(summed[i] if n in _COUNT_METRICS else mean[i])
        e_sum, low_n, high_n, cut_n, n_tok = summed[len(names):]
        n_tok = max(n_tok, 1.0)
        self._metrics[mode]["entropy"].append(e_sum / n_tok)
        self._metrics[mode]["clip_ratio/low_mean"].append(low_n / n_tok)
        self._metrics[mode]["clip_ratio/high_mean"].append(high_n / n_tok)
        self._metrics[mode]["clip_ratio/region_mean"].append(cut_n / n_tok)
        per_seq = torch.stack([low.sum(-1), high.sum(-1)]).float() / valid.sum(-1).float()  # (2, B); NaN: empty
        per_seq = self.accelerator.gather(per_seq.T.contiguous().to(self.accelerator.device))  # (world * B, 2)
        self._metrics[mode]["clip_ratio/low_min"].append(nanmin(per_seq[:, 0]))
        self._metrics[mode]["clip_ratio/high_max"].append(nanmax(per_seq[:, 1]))
        if mode == "train" and rollout is not None:
            self._log_binding(res, valid, adv, rollout, anchor)


class _WithPositions:
    """Calls ``model`` with position ids counted from each row's first real token (what
    :meth:`PDMaskGRPOTrainer._forward_inputs` passes), for TRL's scoring forward."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *, input_ids, attention_mask, **kwargs):
        kwargs.setdefault("position_ids", (attention_mask.long().cumsum(-1) - 1).clamp(min=0))
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def nanmin(x: torch.Tensor) -> float:
    x = x[~torch.isnan(x)]
    return float(x.min()) if x.numel() else float("nan")


def nanmax(x: torch.Tensor) -> float:
    x = x[~torch.isnan(x)]
    return float(x.max()) if x.numel() else float("nan")
