"""``anchor="old"`` in the TRL trainer: the region centred on pi_old from TRL's own old-log-prob
forward (top-K included, no extra forward), mu only in the IS weight pi_old/mu; the refusals
where TRL computes no old log-probs; and the where-it-binds metrics by update index, both
anchors. pi_old is re-derived here from a copy of the weights taken when the batch was
generated, and the generator's mu is perturbed (a noisy engine), so the two anchors differ."""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="needs the trl extra: pip install -e '.[trl]' (run .ci/trl.sh)")
sys.path.insert(0, str(Path(__file__).parent))
import trl_helpers as H  # noqa: E402
from trl import GRPOTrainer as TRLGRPOTrainer  # noqa: E402

import pdmask  # noqa: E402
from pdmask.integrations.trl import GRPOTrainer, binding, options  # noqa: E402

#: run settings where TRL scores each batch for old log-probs (GA=1 < steps_per_generation x num_iterations = 2)
OLD = dict(num_iterations=2, steps_per_generation=1, max_steps=4, learning_rate=0.1)


def _noise(ids: torch.Tensor) -> torch.Tensor:
    """A fixed per-id offset <= 0: the generator's log-probs are pi's minus it (a mismatched engine)."""
    return -0.15 * (1.0 + torch.sin(ids.double() * 1.7)).to(torch.float32)


class OldProbe(GRPOTrainer):
    """Perturbs the captured mu, re-derives pi_old from a copy of the weights at generation, and
    records each micro-batch's loss against the core's anchored loss on those independent values."""

    def __init__(self, *a, **kw):
        self.records, self.scoring_calls = [], 0
        super().__init__(*a, **kw)

    def _generate_single_turn(self, *a, **kw):
        out = super()._generate_single_turn(*a, **kw)
        r = self._pdmask_rollout
        self._pdmask_rollout = r.replace(
            sampled_logprob=r.sampled_logprob + _noise(r.sampled_ids),
            topk_logprobs=None if r.topk_ids is None else r.topk_logprobs + _noise(r.topk_ids))
        return out

    def _get_per_token_logps_and_entropies(self, *a, **kw):
        self.scoring_calls += 1
        return super()._get_per_token_logps_and_entropies(*a, **kw)

    def _generate_and_score_completions(self, inputs):
        snapshot = copy.deepcopy(self.accelerator.unwrap_model(self.model)).eval()  # the weights that generate
        out = super()._generate_and_score_completions(inputs)
        with torch.no_grad():
            lq = self._log_softmax(snapshot, out)
        out["probe_old_lp"] = lq.gather(-1, out["completion_ids"][..., None])[..., 0]
        if "topk_ids" in out:
            out["probe_old_topk"] = lq.gather(-1, out["topk_ids"])
        return out

    def _log_softmax(self, model, inputs) -> torch.Tensor:
        P = inputs["prompt_ids"].shape[1]
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        pos = (am.long().cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, P - 1:-1].float()
        return torch.log_softmax(logits / self.args.temperature, -1)

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        a = self.args
        with torch.no_grad():
            mask = inputs["completion_mask"].bool()
            lq = self._log_softmax(model, inputs)
            rollout = pdmask.Rollout(inputs["completion_ids"], inputs["sampled_logprob"], inputs.get("topk_ids"),
                                     inputs.get("topk_logprobs"), mask)
            spec = options.loss_spec(a)
            anchor = pdmask.Anchor(inputs["probe_old_lp"], inputs.get("probe_old_topk")) if spec.anchored else None
            ref = spec(lq * a.temperature, rollout, inputs["advantages"], anchor=anchor)  # logits / T = lq (+ const)
            self.records.append({
                "loss": loss.detach().clone(), "expected": H.hand_aggregate(ref.token_loss, mask, self, inputs),
                "inputs": {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)},
                "kept": ref.mask, "mask": mask, "metrics": ref.metrics, "step": self._step,
                "rollout_loss": dataclasses.replace(spec, anchor="rollout")(lq * a.temperature, rollout,
                                                                            inputs["advantages"]).token_loss,
            })
        return loss


def _run(tmp_path, **kw):
    tr = H.make_trainer(tmp_path, cls=OldProbe, **kw)
    tr.train()
    return tr


def _logs(tr) -> list[dict]:
    return [h for h in tr.state.log_history if "pdmask/kept_frac" in h]


@pytest.mark.parametrize("mode,k", [("pdm-topk-kl", 4), ("dppo-binary-tv", 0), ("grpo", 0)])
def test_old_anchor_is_trls_pi_old_and_the_loss_uses_it(tmp_path, mode, k):
    tr = _run(tmp_path, mask_mode=mode, rollout_top_k=k, anchor="old", mask_delta_low=None if mode == "grpo" else 1e-3,
              mask_delta_high=None if mode == "grpo" else 1e-3, **OLD)
    assert len(tr.records) == 4
    assert tr.scoring_calls == 2  # one old-log-prob forward per generation batch: no extra forward
    for rec in tr.records:
        inp, m = rec["inputs"], rec["mask"]
        # TRL's old_per_token_logps (and the top-K from the same forward) are pi_old: the weights that generated
        torch.testing.assert_close(inp["old_per_token_logps"][m], inp["probe_old_lp"][m], atol=2e-5, rtol=0)
        if k:
            torch.testing.assert_close(inp["old_topk_logprobs"][m], inp["probe_old_topk"][m], atol=2e-5, rtol=0)
        else:
            assert "old_topk_logprobs" not in inp
        torch.testing.assert_close(rec["loss"], rec["expected"], atol=1e-5, rtol=1e-4)
        # the noisy engine: pi_old / mu != 1, so the anchored loss is not the rollout-anchored one
        assert float(rec["metrics"]["behaviour_abs_log_ratio_mean"]) > 0.05
    assert any(not torch.allclose(H.hand_aggregate(r["rollout_loss"], r["mask"], tr, r["inputs"]), r["loss"])
               for r in tr.records), "the two anchors gave the same loss: the test could not tell them apart"


def test_old_anchor_from_hidden_states(tmp_path):
    tr = _run(tmp_path, mask_mode="pdm-topk-tv", anchor="old", loss_from_hidden=True, mask_chunk_size=5,
              mask_delta_low=1e-3, mask_delta_high=1e-3, **OLD)
    for rec in tr.records:
        inp, m = rec["inputs"], rec["mask"]
        torch.testing.assert_close(inp["old_topk_logprobs"][m], inp["probe_old_topk"][m], atol=2e-5, rtol=0)
        torch.testing.assert_close(rec["loss"], rec["expected"], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kw,match", [
    ({"anchor": "old", "num_iterations": 1, "steps_per_generation": 1},
     r"^anchor: 'old' .* gradient_accumulation_steps=1 is a multiple of steps_per_generation x num_iterations = 1 x 1"),
    ({"anchor": "old", "num_iterations": 2, "steps_per_generation": 1, "gradient_accumulation_steps": 2},
     r"^anchor: .*gradient_accumulation_steps=2 is a multiple of .* 1 x 2"),
    ({"anchor": "mu"}, r"^anchor: unknown value 'mu'; valid values are: rollout, old"),
    ({"anchor": "old", "top_k": 5, **{k: OLD[k] for k in ("num_iterations", "steps_per_generation")}},
     r"^anchor: truncated sampling"),
])
def test_old_anchor_refused_where_trl_computes_no_old_logprobs(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match) as e:
        H.config(tmp_path, **kw)
    assert "\n" not in str(e.value)


def test_ratio_modes_take_trls_vllm_correction_with_the_old_anchor(tmp_path):
    """With anchor='old' the grpo ratio is pi/pi_old, so TRL's vLLM IS weight (pi_old/mu) is no
    longer counted twice: it becomes the behaviour weight (refused with the rollout anchor)."""
    a = H.config(tmp_path, mask_mode="grpo", rollout_top_k=0, anchor="old", **{k: OLD[k] for k in
                 ("num_iterations", "steps_per_generation")})
    a.use_vllm, a.vllm_importance_sampling_correction = True, True
    assert options._refuse_vllm_is(a) is None
    c = options.corrections(a)
    assert (c.is_level, c.is_mask, c.is_cap) == (*options.VLLM_IS_MODES[a.vllm_importance_sampling_mode],
                                                 a.vllm_importance_sampling_clip_max)
    a.anchor = "rollout"
    assert "already weights by its ratio" in options._refuse_vllm_is(a)


def test_grpo_old_anchor_equals_trls_own_three_policy_loss(tmp_path):
    """mask_mode='grpo', anchor='old' is TRL's own objective with its vLLM IS correction:
    -min(r A, clip(r) A) * (pi_old / mu), r = pi / pi_old; TRL's _compute_loss on the same batch."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_trl_peer import _batch, _loss_and_grads

    tr = H.make_trainer(tmp_path, cls=GRPOTrainer, mask_mode="grpo", rollout_top_k=0, loss_type="dapo",
                        epsilon_high=0.28, bf16=False, anchor="old",
                        **{k: OLD[k] for k in ("num_iterations", "steps_per_generation")})
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1
    inputs, r = _batch(tr)  # old_per_token_logps: pi / r (TRL's ratio r on each side of the clip)
    old = inputs["old_per_token_logps"]
    rho = torch.linspace(0.4, 2.5, old.numel()).reshape(old.shape)  # pi_old / mu, below both caps (3 and 5)
    inputs["sampled_logprob"] = (old - rho.log()).clamp(max=-1e-3)  # a log-prob: <= 0
    rho = torch.exp(old - inputs["sampled_logprob"])
    assert float(rho.min()) < 0.9 and 1.5 < float(rho.max()) < 3.0  # the weight matters, no cap applies
    inputs["importance_sampling_ratio"] = rho  # TRL's weight, exp(old - sampling), truncated at 3
    ours, g_ours, _ = _loss_and_grads(tr._compute_loss, tr, inputs)
    tr.use_vllm, tr.vllm_importance_sampling_correction = True, True  # TRL's branch that multiplies the weight
    theirs, g_theirs, _ = _loss_and_grads(lambda m, x: TRLGRPOTrainer._compute_loss(tr, m, x), tr, inputs)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    for a, b in zip(g_ours, g_theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


# ------------------------------------------------------------------ where the region binds
def _schedule(n: int, ga: int, spg: int, ni: int) -> list[int]:
    """TRL's schedule written out: generate every spg x ni micro-steps, an optimizer step every ga."""
    out, opt, at_gen = [], 0, 0
    for step in range(n):
        if step % (spg * ni) == 0:
            at_gen = opt
        out.append(opt - at_gen + 1)
        if (step + 1) % ga == 0:
            opt += 1
    return out


@pytest.mark.parametrize("ga,spg,ni", [(1, 1, 2), (1, 4, 1), (2, 4, 1), (3, 2, 1), (2, 2, 3), (4, 2, 1), (1, 1, 1)])
def test_update_index_follows_trls_schedule(ga, spg, ni):
    want = _schedule(48, ga, spg, ni)
    assert [binding.update_index(s, ga, spg, ni) for s in range(48)] == want


@pytest.mark.parametrize("anchor", ["old", "rollout"])
def test_binding_metrics_by_update_index(tmp_path, anchor):
    tr = _run(tmp_path, mask_mode="pdm-topk-kl", anchor=anchor, mask_delta_low=1e-3, mask_delta_high=1e-3, **OLD)
    logs = _logs(tr)
    assert len(logs) == len(tr.records) == 4  # GA = 1, logging_steps = 1: one micro-batch per log line
    us = _schedule(4, 1, 1, 2)
    assert us == [1, 2, 1, 2]
    for h, rec, u in zip(logs, tr.records, us, strict=True):
        m, kept = rec["mask"], rec["kept"]
        adv = rec["inputs"]["advantages"][:, None].expand_as(m)
        cut = ~kept & m
        n = int(m.sum())
        assert f"pdmask/mb{u}_masked_frac" in h and f"pdmask/mb{3 - u}_masked_frac" not in h
        assert h[f"pdmask/mb{u}_masked_frac"] == pytest.approx(float(cut.sum()) / n, abs=1e-6)
        assert h[f"pdmask/mb{u}_out_of_region_frac"] == pytest.approx(h["pdmask/out_of_region_frac"], abs=1e-6)
        for name, sel in (("pos", adv > 0), ("neg", adv < 0)):
            den = int((sel & m).sum())
            want = float((cut & sel).sum()) / den if den else 0.0
            assert h[f"pdmask/masked_share_{name}_adv"] == pytest.approx(want, abs=1e-6)
        assert ("pdmask/out_before_update_frac" in h) == (u == 1)
        if u == 1:
            assert h["pdmask/out_before_update_frac"] == pytest.approx(h["pdmask/out_of_region_frac"], abs=1e-6)
            if anchor == "old":  # pi = pi_old before any update: nothing out; the start distance is D(mu, pi_old)
                assert h["pdmask/out_before_update_frac"] == 0.0
                assert h["pdmask/start_divergence_mean"] == pytest.approx(h["pdmask/anchor_divergence_mean"], rel=1e-4)
                assert h["pdmask/start_divergence_mean"] > 1e-3  # the noisy engine is far from pi_old
                assert h["pdmask/mu_region_out_frac_at_start"] == pytest.approx(
                    h["pdmask/anchor_out_of_region_frac"], abs=1e-6)
            else:  # the region measures D(mu, pi) = D(mu, pi_old) at u = 1: the engine's noise binds it
                assert h["pdmask/start_divergence_mean"] == pytest.approx(h["pdmask/divergence_mean"], rel=1e-4)
                assert h["pdmask/mu_region_out_frac_at_start"] == h["pdmask/out_before_update_frac"]
                assert h["pdmask/out_before_update_frac"] > 0.5 or not bool(adv.any())  # A = 0: never out
            assert 0 <= h["pdmask/start_divergence_q50"] <= h["pdmask/start_divergence_q90"] \
                <= h["pdmask/start_divergence_suggested_delta"]
    assert any(h.get("pdmask/mb2_masked_frac", 0) > 0 for h in logs), "no token was masked after an update"
    assert all(math.isfinite(v) for h in logs for k, v in h.items() if k.startswith("pdmask/"))


@pytest.mark.parametrize("anchor", ["rollout", "old"])
def test_a_region_out_before_any_update_warns_once_per_run(tmp_path, recwarn, anchor):
    """A delta far below the noisy engine's distance: most tokens are out of the mu-centred region
    at u = 1 of both generation batches, one warning naming delta, q50 / q90 and the suggestion
    (the logged numbers); centred on pi_old nothing is out before an update: no warning."""
    tr = _run(tmp_path, mask_mode="pdm-topk-kl", anchor=anchor, mask_delta_low=1e-6, mask_delta_high=1e-6, **OLD)
    msgs = [str(w.message) for w in recwarn.list if "out of region before any update" in str(w.message)]
    starts = [h for h in _logs(tr) if "pdmask/out_before_update_frac" in h]
    assert len(starts) == 2
    if anchor == "old":
        assert msgs == [] and all(h["pdmask/out_before_update_frac"] == 0.0 for h in starts)
        return
    assert len(msgs) == 1, msgs
    h = starts[0]
    assert h["pdmask/out_before_update_frac"] > 0.5
    assert msgs[0].startswith("pdmask: step 1: ")
    for part in (f"{h['pdmask/out_before_update_frac']:.1%}", "delta = 1e-06/1e-06",
                 f"q50 {h['pdmask/start_divergence_q50']:.3g}", f"q90 {h['pdmask/start_divergence_q90']:.3g}",
                 f"delta ~ {h['pdmask/start_divergence_suggested_delta']:.3g}", 'anchor="old"'):
        assert part in msgs[0], (part, msgs[0])


@pytest.mark.parametrize("anchored", [False, True])
def test_the_warning_reads_the_regions_own_divergence(anchored):
    """Centred on pi_old the region's divergence at u = 1 is against pi_old (the unlogged
    ``region_*`` quantiles), not the start distance D(mu, pi_old); the hint follows the anchor."""
    spec = dataclasses.make_dataclass("S", ["anchored", "thresholds"])(anchored, pdmask.Thresholds(0.01, 0.02))
    m = {"out_before_update_frac": 0.25, "start_divergence_q50": 0.111, "start_divergence_q90": 0.222,
         "start_divergence_suggested_delta": 0.333}
    means = {"region_q50": 0.0044, "region_q90": 0.0055, "region_suggested_delta": 0.0066}
    msg = binding.region_warning(m, means, spec)
    want = ("0.0044", "0.0055", "0.0066") if anchored else ("0.111", "0.222", "0.333")
    assert all(w in msg for w in want) and "25.0%" in msg and "delta = 0.01/0.02" in msg, msg
    assert msg.endswith(binding.HINTS["old" if anchored else "rollout"])
    assert binding.region_warning({**m, "out_before_update_frac": 0.05}, means, spec) is None
    assert binding.region_warning({"mb2_masked_frac": 0.5}, means, spec) is None  # not u = 1


def test_example_runs_with_the_old_anchor(tmp_path, capsys):
    """examples/trl/train_grpo.py --anchor old --num-iterations 2 (the tiny model)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_grpo", Path(__file__).parents[2] / "examples" / "trl" /
                                                  "train_grpo.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    tr = ex.main(["--anchor", "old", "--num-iterations", "2", "--max-steps", "2", "--output-dir", str(tmp_path)])
    assert tr.args.anchor == "old" and tr.args.num_iterations == 2
    logs = _logs(tr)
    assert len(logs) == 2 and all("pdmask/behaviour_weight_mean" in h for h in logs)
    assert "pdmask/out_before_update_frac" in logs[0] and "pdmask/mb2_masked_frac" in logs[1]
    assert "step 2: loss" in capsys.readouterr().out
