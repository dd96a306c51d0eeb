"""The rollout top-K from the agent loop's output to the registered loss, through verl's own
data path: the v1 trainer (``trainer.use_v1=true``, verl 0.9.1's default: TransferQueue)
and the legacy trainer (``trainer.use_v1=false``: ``DataProto``).

Both start from ``AgentLoopOutput`` s carrying the replica's four ``pdmask_*`` arrays in
``extra_fields`` (what ``SingleTurnAgentLoop.run`` builds from the ``TokenOutput`` of the
``pdmask_vllm`` server) and end in the actor update, with the loss, its gradient and the
metrics the trainer logs compared against ``pdmask.policy_loss`` on logits computed
directly from the model:

- v1: ``AgentLoopWorkerTQ._agent_loop_postprocess`` (``as_dict``, ``list_of_dict_to_tensordict``,
  put) -> TransferQueue (:mod:`verl_tq`) -> ``PPOTrainer._compute_old_log_prob`` (bypass
  mode) and ``_compute_advantage`` (GRPO) -> ``PPOTrainer._update_actor`` ->
  ``ActorRolloutRefWorker.update_actor`` (``tqbridge``) -> ``TrainingWorker.train_mini_batch``
  -> the pdmask engine -> ``ppo_loss`` -> the registered loss;
- legacy: ``AgentLoopWorker._agent_loop_postprocess`` (padding) and ``_postprocess``
  (``DataProto``) -> ``DataProto.to_tensordict`` + ``left_right_2_no_padding`` (what
  ``RayPPOTrainer._update_actor`` does) -> the same worker stack.

Every step is verl's code except TransferQueue's Ray actors and sockets (see
:mod:`verl_tq`) and the worker construction (see :mod:`verl_workers`). The trainer config
is verl's ``ppo_trainer.yaml`` composed with ``examples/verl/run_pdm_topk_kl.sh``'s overrides.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from verl_helpers import compose_config, needs_verl, script_overrides
from verl_rollout import TEMP, Rollout, build, reference

pytestmark = needs_verl

N = 2                      # rollout.n: samples per prompt
PROMPT_LENS = (3, 3, 4, 4)  # two prompts, each sampled N times
RESP_LENS = (5, 3, 6, 4)
REWARDS = (1.0, 0.0, 0.0, 1.0)
MICRO = 2                  # ppo_micro_batch_size_per_gpu: two micro-batches


def _rollout(seed: int) -> Rollout:
    r = build(seed, prompt_lens=PROMPT_LENS, resp_lens=RESP_LENS, mode_shift=1.5)
    # one prompt per group, as rollout.n samples of the same prompt
    for b in range(len(r.prompts)):
        r.prompts[b] = list(r.prompts[b - b % N])
    return r


def _config(loss_mode: str, *, use_v1: bool, extra=()):
    mine = {o.split("=")[0] for o in extra}  # the extra overrides replace the script's
    script = [o for o in script_overrides(LOSS_MODE=loss_mode)
              if not o.startswith("trainer.use_v1=") and o.split("=")[0] not in mine]
    return compose_config(script + [
        f"trainer.use_v1={str(use_v1).lower()}",
        f"actor_rollout_ref.rollout.n={N}",
        f"actor_rollout_ref.rollout.temperature={TEMP}",
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",       # x rollout.n = the whole batch
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MICRO}",
        *extra,
    ])


def _agent_loop_outputs(r: Rollout):
    """``SingleTurnAgentLoop.run``'s output for each sample: ``extra_fields`` is the server's
    ``TokenOutput.extra_fields`` (the replica's arrays) plus the loop's own two keys."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    outs = []
    for b, f in enumerate(r.fields):
        out = AgentLoopOutput(
            prompt_ids=r.prompts[b], response_ids=r.responses[b], response_mask=[1] * len(r.responses[b]),
            response_logprobs=[float(x) for x in f["pdmask_sampled_logprobs"]], num_turns=2,
            metrics=AgentLoopMetrics(), extra_fields=dict(f))
        out.extra_fields.update({"turn_scores": [], "tool_rewards": []})
        out.reward_score = REWARDS[b]  # what the reward loop assigns (AgentLoopWorker._compute_score)
        outs.append(out)
    return outs


def _sample_kwargs(b: int) -> dict:
    """The dataset fields ``_run_agent_loop`` passes on (one prompt's row, its session id)."""
    return dict(uid=f"prompt{b // N}", session_id=b % N, index=b // N, global_steps=1, data_source="toy",
                raw_prompt=[{"role": "user", "content": f"prompt {b // N}"}])


def _grads(eng):
    assert len(eng.optimizer.steps) == 1, "expected one optimizer step (one mini-batch)"
    return eng.optimizer.steps[0]


def _check_against_reference(r, adv, loss_mode, mode, estimator, metrics, eng, delta):
    """The actor's summed micro-batch loss, its gradient and the logged metrics against
    ``pdmask.policy_loss`` on the whole batch (loss, gradient) and on each micro-batch (the
    fractions verl averages over micro-batches)."""
    ref = reference(r, adv, mode, estimator, delta_low=delta, delta_high=delta, loss_agg="token-mean")
    ref_grads = torch.autograd.grad(ref.loss, [r.model.E, r.model.Pe])
    for g, rg in zip(_grads(eng), ref_grads, strict=True):
        torch.testing.assert_close(g, rg, rtol=1e-9, atol=1e-12)
    assert metrics["actor/pg_loss"] == pytest.approx(float(ref.loss.detach()), rel=1e-9)
    assert 0 < float(ref.metrics["masked_frac"]) < 1, "the batch must mask some tokens, not all"
    per_micro = []
    for lo in range(0, len(r.prompts), MICRO):
        sl = slice(lo, lo + MICRO)
        sub = Rollout(r.model, r.prompts[sl], r.responses[sl], r.fields[sl], adv[sl])
        T = sub.T
        per_micro.append(reference(sub, adv[sl, :T], mode, estimator, delta_low=delta, delta_high=delta).metrics)
    for k in ("kept_frac", "masked_frac", "out_of_region_frac", "disagreement_frac", "divergence_mean",
              "rollout_tail_mass_mean", "entropy_mean", "num_tokens"):
        want = float(np.mean([float(m[k]) for m in per_micro]))
        assert metrics[f"actor/pdmask/{k}"] == pytest.approx(want, rel=1e-6, abs=1e-9), k
    assert metrics["actor/pg_clipfrac"] == pytest.approx(metrics["actor/pdmask/masked_frac"])
    assert "actor/ppo_kl" in metrics


# ------------------------------------------------------------------ v1 (TransferQueue)
def _run_v1(monkeypatch, tmp_path, loss_mode, *, seed=1, strip_topk=False, extra=(), after_old=None):
    import verl.trainer.ppo.v1.agent_loop_tq as agent_loop_tq
    from transfer_queue import KVBatchMeta
    from verl.trainer.distillation import is_distillation_enabled
    from verl.trainer.ppo.v1 import get_trainer_cls

    import verl_tq
    from verl_workers import actor_stack, gloo_group

    gloo_group(tmp_path)
    store = verl_tq.install(monkeypatch)
    cfg = _config(loss_mode, use_v1=True, extra=extra)
    r = _rollout(seed)

    # agent loop worker -> TransferQueue (AgentLoopWorkerTQ is a Ray actor class; its
    # methods run here on a plain instance with the attributes a text-only worker has)
    loop_worker = object.__new__(agent_loop_tq.AgentLoopWorkerTQ.__ray_metadata__.modified_class)
    loop_worker.processor, loop_worker.reward_loop_worker_handles, loop_worker.distillation_enabled = None, None, False
    outs = _agent_loop_outputs(r)
    if strip_topk:
        for o in outs:
            for k in list(o.extra_fields):
                if k.startswith("pdmask_"):
                    del o.extra_fields[k]
    for b, out in enumerate(outs):
        asyncio.run(loop_worker._agent_loop_postprocess(out, False, **_sample_kwargs(b)))

    # trainer: what ReplayBuffer.sample hands _step_once, then its steps 4, 7 and 9
    keys = [f"prompt{b // N}_{b % N}_0" for b in range(len(outs))]
    batch = KVBatchMeta(keys=keys, tags=[store.tags["train"][k] for k in keys], partition_id="train")
    batch.extra_info["temperature"] = cfg.actor_rollout_ref.rollout.temperature
    worker, eng = actor_stack(monkeypatch, cfg, r.model)
    assert not is_distillation_enabled(cfg.get("distillation"))
    trainer = object.__new__(get_trainer_cls(cfg.trainer.v1.trainer_mode))  # the default mode's trainer
    trainer.config, trainer.actor_rollout_wg = cfg, worker
    metrics: dict = {}
    batch = trainer._compute_old_log_prob(batch, metrics)
    if after_old is not None:  # e.g. move the weights: the update's pi is then not the pass's pi_old
        after_old(r)
    batch = trainer._compute_advantage(batch, metrics)
    adv = store.kv_batch_get(keys, "train", ["advantages"])["advantages"].to_padded_tensor(0.0).double()
    trainer._update_actor(batch, metrics)
    return r, adv, metrics, eng, store


@pytest.mark.parametrize("loss_mode,mode,estimator", [
    ("pdmask_pdm_topk_kl", "pdm-topk-kl", "exact"),
    ("pdmask_dppo_topk_tv", "dppo-topk-tv", "exact"),
])
def test_v1_agent_loop_output_reaches_the_loss(monkeypatch, tmp_path, loss_mode, mode, estimator):
    r, adv, metrics, eng, store = _run_v1(monkeypatch, tmp_path, loss_mode)
    # the hop the issue names: as_dict leaves the arrays inside the per-sample extra_fields
    # dict, which TransferQueue stores as one column
    fields = store.kv_batch_get([f"prompt{b // N}_{b % N}_0" for b in range(4)], "train")
    assert "extra_fields" in fields.keys() and "pdmask_topk_ids" not in fields.keys()
    extras = fields.get("extra_fields").tolist()
    np.testing.assert_array_equal(extras[2]["pdmask_topk_ids"], r.fields[2]["pdmask_topk_ids"])
    assert sorted(torch.unique(adv[adv != 0]).sign().tolist()) == [-1.0, 1.0]  # GRPO made both signs
    _check_against_reference(r, adv, loss_mode, mode, estimator, metrics, eng, 0.05)  # the script's DELTA


def test_v1_without_the_replica_names_the_rollout_setting(monkeypatch, tmp_path):
    """The pdmask engine is set but the responses carry no top-K (a stock rollout): the
    error names rollout.name, not the engine the user already set."""
    with pytest.raises(ValueError, match=r"rollout\.name.*pdmask_vllm"):
        _run_v1(monkeypatch, tmp_path, "pdmask_pdm_topk_kl", strip_topk=True)


# ------------------------------------------------------------------ legacy (DataProto)
def _pad_tokenizer():
    """A word-level tokenizer over the tiny vocabulary: the legacy agent loop pads with
    ``tokenizer.pad``."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from verl_rollout import V

    vocab = {f"t{i}": i for i in range(V)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
                                   pad_token="t0", unk_token="t1")


def _run_legacy(monkeypatch, tmp_path, loss_mode, *, seed=1):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.protocol import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage
    from verl.utils.metric import reduce_metrics

    from verl_workers import actor_stack, gloo_group

    gloo_group(tmp_path)
    cfg = _config(loss_mode, use_v1=False)
    r = _rollout(seed)
    w = object.__new__(AgentLoopWorker)
    w.processor, w.reward_loop_worker_handles, w.distillation_enabled = None, None, False
    w.mm_processor_kwargs = None
    w.tokenizer = _pad_tokenizer()
    w.rollout_config = cfg.actor_rollout_ref.rollout
    # prompt_length / response_length pad the batch (left / right)
    w.rollout_config.prompt_length, w.rollout_config.response_length = max(PROMPT_LENS) + 1, max(RESP_LENS) + 2
    internal = [asyncio.run(w._agent_loop_postprocess(out, False, **_sample_kwargs(b)))
                for b, out in enumerate(_agent_loop_outputs(r))]
    dp: DataProto = w._postprocess(internal, input_non_tensor_batch=None, validate=False)
    # the legacy trainer: GRPO advantages, bypass-mode anchor, then RayPPOTrainer._update_actor
    dp.batch["token_level_rewards"] = dp.batch["rm_scores"]
    dp.non_tensor_batch["uid"] = np.array([_sample_kwargs(b)["uid"] for b in range(len(r.prompts))], dtype=object)
    dp = compute_advantage(dp, adv_estimator=cfg.algorithm.adv_estimator, num_repeat=N)
    dp.batch["old_log_probs"] = dp.batch["rollout_log_probs"]
    worker, eng = actor_stack(monkeypatch, cfg, r.model)
    trainer = object.__new__(RayPPOTrainer)
    trainer.config, trainer.actor_rollout_wg = cfg, worker
    out = RayPPOTrainer._update_actor(trainer, dp)  # to_tensordict, left_right_2_no_padding, update_actor
    metrics = reduce_metrics(out.meta_info["metrics"])
    adv = dp.batch["advantages"][:, :r.T].double()
    return r, adv, metrics, eng, dp


def test_legacy_agent_loop_output_reaches_the_loss(monkeypatch, tmp_path):
    r, adv, metrics, eng, dp = _run_legacy(monkeypatch, tmp_path, "pdmask_pdm_topk_kl")
    # the legacy hop: every extra_fields key becomes its own per-sample object array
    assert dp.non_tensor_batch["pdmask_topk_ids"].shape == (4,)
    _check_against_reference(r, adv, "pdmask_pdm_topk_kl", "pdm-topk-kl", "exact", metrics, eng, 0.05)


# ------------------------------------------------------------------ decoupled mode: the pi_old anchor
DECOUPLED = ("algorithm.rollout_correction.bypass_mode=false",)


def _perturb(r):
    """Move the weights after the old-log-prob pass (the optimizer's lr is 0): the update's pi
    then differs from the pass's pi_old, as on any mini-batch after the first."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        r.model.E.add_(torch.randn(r.model.E.shape, generator=g, dtype=r.model.E.dtype) * 0.05)


def _anchored_reference(r, old_model, adv, mode, *, delta, is_cap=5.0, response_mask=None, rows=slice(None)):
    """``pdmask.PolicyLoss(anchor="old")`` on logits computed directly from the tiny model (pi) and
    from its copy taken before the weights moved (pi_old, stored float32 as verl stores log-probs)."""
    from verl_rollout import K, TEMP, response_logits

    import pdmask

    sub = Rollout(r.model, r.prompts[rows], r.responses[rows], r.fields[rows], adv[rows])
    B, T = len(sub.prompts), sub.T
    mask = torch.zeros(B, T, dtype=torch.bool)
    ids, rlp = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.float64)
    tk, tl = torch.zeros(B, T, K, dtype=torch.long), torch.zeros(B, T, K, dtype=torch.float64)
    for b, f in enumerate(sub.fields):
        n = len(sub.responses[b])
        mask[b, :n] = True
        ids[b, :n] = torch.as_tensor(f["pdmask_sampled_ids"])
        rlp[b, :n] = torch.as_tensor(f["pdmask_sampled_logprobs"], dtype=torch.float32).double()
        tk[b, :n] = torch.as_tensor(f["pdmask_topk_ids"])
        tl[b, :n] = torch.as_tensor(f["pdmask_topk_logprobs"], dtype=torch.float32).double()
    if response_mask is not None:
        mask = mask & response_mask[rows, :T].bool()
    t32 = float(torch.tensor(TEMP, dtype=torch.float32))  # verl scales the logits by a float32 temperature
    rollout = pdmask.Rollout(ids, rlp, tk, tl, mask)
    with torch.no_grad():
        lq = torch.log_softmax(response_logits(sub, old_model) / t32, -1)
    anchor = pdmask.Anchor(lq.gather(-1, ids[..., None])[..., 0].float().double(), lq.gather(-1, tk).float().double())
    spec = pdmask.PolicyLoss(mode=mode, thresholds=pdmask.Thresholds(delta, delta), anchor="old",
                             corrections=pdmask.Corrections(is_cap=is_cap), sampling=pdmask.Sampling(temperature=t32))
    return spec(response_logits(sub), rollout, adv[rows, :T], anchor=anchor), anchor


@pytest.mark.parametrize("loss_mode,mode", [("pdmask_pdm_topk_kl", "pdm-topk-kl"),
                                            ("pdmask_pdm_smooth_topk_tv", "pdm-smooth-topk-tv")])
def test_v1_decoupled_mode_centres_the_topk_region_on_pi_old(monkeypatch, tmp_path, loss_mode, mode):
    """bypass_mode=false, v1 trainer: the pdmask engine scores pi_old's top-K in verl's own
    old-log-prob pass, verl carries it through TransferQueue to the update, and the loss is the
    core's anchored loss: region and ratio against pi_old, mu only in min(pi_old / mu, C)."""
    import copy

    snap = {}
    r, adv, metrics, eng, store = _run_v1(
        monkeypatch, tmp_path, loss_mode, extra=DECOUPLED,
        after_old=lambda r: (snap.setdefault("old", copy.deepcopy(r.model)), _perturb(r)))
    keys = [f"prompt{b // N}_{b % N}_0" for b in range(4)]
    fields = store.kv_batch_get(keys, "train")
    assert "pdmask_old_topk_0" in fields.keys() and f"pdmask_old_topk_{r.fields[0]['pdmask_topk_ids'].shape[-1]}" \
        not in fields.keys()
    ref, anchor = _anchored_reference(r, snap["old"], adv, mode, delta=0.05)
    # the carried pi_old is the pass's (before the weights moved), at the engine's top-K ids
    got = fields["pdmask_old_topk_1"]
    for b in range(4):
        P, n = len(r.prompts[b]), len(r.responses[b])
        vals = got[b][P - 1:P - 1 + n].double()
        torch.testing.assert_close(vals, anchor.topk_logprobs[b, :n, 1], rtol=0, atol=1e-6)
    ref_grads = torch.autograd.grad(ref.loss, [r.model.E, r.model.Pe])
    for g, rg in zip(_grads(eng), ref_grads, strict=True):
        torch.testing.assert_close(g, rg, rtol=1e-5, atol=1e-8)
    assert metrics["actor/pg_loss"] == pytest.approx(float(ref.loss.detach()), rel=1e-5)
    # the two anchors differ on this batch: mu's region would give another loss
    mu_ref = reference(r, adv, mode, "exact", delta_low=0.05, delta_high=0.05, loss_agg="token-mean")
    assert float(mu_ref.loss) != pytest.approx(float(ref.loss), rel=1e-3)
    # anchored and where-it-binds metrics, averaged over the two micro-batches as verl averages
    per = [_anchored_reference(r, snap["old"], adv, mode, delta=0.05, rows=slice(lo, lo + MICRO))[0].metrics
           for lo in range(0, 4, MICRO)]
    for k in ("behaviour_weight_mean", "behaviour_abs_log_ratio_mean", "anchor_divergence_mean",
              "anchor_out_of_region_frac", "out_of_region_frac", "masked_frac"):
        want = float(np.mean([float(m[k]) for m in per]))
        assert metrics[f"actor/pdmask/{k}"] == pytest.approx(want, rel=1e-4, abs=1e-6), k
    assert float(per[0]["behaviour_abs_log_ratio_mean"]) > 0.05  # pi_old / mu != 1: the weight acts
    # one mini-batch: update index 1, the step's start (pi moved only by the test's perturbation)
    assert metrics["actor/pdmask/mb1_masked_frac"] == pytest.approx(metrics["actor/pdmask/masked_frac"])
    assert metrics["actor/pdmask/start_divergence_mean"] == pytest.approx(
        metrics["actor/pdmask/anchor_divergence_mean"])
    q50, q90, sug = (metrics[f"actor/pdmask/start_divergence_{k}"] for k in ("q50", "q90", "suggested_delta"))
    assert 0 < q50 <= q90 + 1e-6 and q50 <= sug  # D(mu, pi_old)'s quantiles (q90 in float32)
    assert "actor/pdmask/mb2_masked_frac" not in metrics


def test_v1_decoupled_mode_warns_once_when_the_region_starts_out(monkeypatch, tmp_path, recwarn):
    """A delta far below the test's weight perturbation: at update index 1 most tokens are out of
    the pi_old-centred region; the first micro-batch there warns, the second does not (the
    check is made once per process, docs/verl.md)."""
    from pdmask.integrations.verl import binding

    monkeypatch.setitem(binding._REGION_CHECKED, "done", False)
    tiny = ("actor_rollout_ref.actor.clip_ratio_low=1e-6", "actor_rollout_ref.actor.clip_ratio_high=1e-6")
    _, _, metrics, _, _ = _run_v1(monkeypatch, tmp_path, "pdmask_pdm_topk_kl", extra=DECOUPLED + tiny,
                                  after_old=_perturb)
    msgs = [str(w.message) for w in recwarn.list if "out of region before any update" in str(w.message)]
    assert metrics["actor/pdmask/out_before_update_frac"] > 0.5
    assert len(msgs) == 1 and msgs[0].startswith("pdmask (verl): ") and "delta = 1e-06/1e-06" in msgs[0], msgs
    assert binding._REGION_CHECKED["done"]


def test_v1_decoupled_mode_takes_verls_rollout_is_weights(monkeypatch, tmp_path):
    """rollout_is=token: verl's weight min(pi_old / mu, 2), computed on the driver from the same
    pi_old and mu, is the behaviour weight of the anchored top-K loss."""
    import copy

    snap = {}
    extra = DECOUPLED + ("algorithm.rollout_correction.rollout_is=token",
                         "algorithm.rollout_correction.rollout_is_threshold=2.0")
    r, adv, metrics, eng, store = _run_v1(
        monkeypatch, tmp_path, "pdmask_pdm_topk_kl", extra=extra,
        after_old=lambda r: snap.setdefault("old", copy.deepcopy(r.model)))
    # no weight moved: pi = pi_old, so min(pi / pi_old, 5) = 1 and the only weight is verl's
    ref, _ = _anchored_reference(r, snap["old"], adv, "pdm-topk-kl", delta=0.05, is_cap=2.0)
    ref_grads = torch.autograd.grad(ref.loss, [r.model.E, r.model.Pe])
    for g, rg in zip(_grads(eng), ref_grads, strict=True):
        torch.testing.assert_close(g, rg, rtol=1e-5, atol=1e-8)
    assert metrics["actor/pg_loss"] == pytest.approx(float(ref.loss.detach()), rel=1e-5)
    # verl's weights are the behaviour weight, and its threshold bites (the cap of 5 would give another loss)
    w = store.kv_batch_get([f"prompt{b // N}_{b % N}_0" for b in range(4)], "train")["rollout_is_weights"].values()
    assert bool((w == 2.0).any()) and float(w.min()) < 1.0
    uncapped, _ = _anchored_reference(r, snap["old"], adv, "pdm-topk-kl", delta=0.05, is_cap=5.0)
    assert float(uncapped.loss) != pytest.approx(float(ref.loss), rel=1e-4)
