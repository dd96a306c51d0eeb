"""The pdm-batch-* modes in the built-in trainer: the mask is computed on the trainer's own
forward with the optimizer's current state, the loss applies exactly batch_mask's mask,
and the modes train end to end, deterministically and resumably."""

import copy

import pytest
import torch

import pdmask

from pdmask_lab.batchmask import batch_mask
from pdmask.engine.hf import HFEngine, response_logits
from tests.flat import policy_loss
from pdmask.train.config import load_config, replace
from pdmask.train.grpo import TIME_KEYS, train
from pdmask.train.logging import read_jsonl
from pdmask.train.model import build_model
from pdmask.train.update import compute_loss, make_optimizer, update_step

BATCH_MODES = ["pdm-batch-topk-kl", "pdm-batch-topk-tv", "pdm-batch-all-topk-kl", "pdm-batch-all-topk-tv"]
TINY = ["hidden_size=32", "num_layers=2", "num_heads=4", "intermediate_size=64", "temperature=0.8",
        "engine_precision=bf16", "lr=1e-2"]


@pytest.fixture(scope="module")
def setup():
    """A tied 2-block Llama, a bf16 engine's rollout and an AdamW that has taken two steps."""
    cfg = load_config(None, TINY + ["mode=dppo-topk-kl"])
    model = build_model(cfg, 97, pad_id=0, eos_id=1, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # tied: sharper distributions than the default init
    eng = HFEngine(model, eos_id=1, pad_id=0, precision="bf16", temperature=0.8, top_k_logprobs=20)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 97, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (12,), generator=g)]
    batch = eng.generate(prompts, max_new_tokens=10, seed=0)
    adv = torch.linspace(-1.5, 1.5, 12)
    opt = make_optimizer(model, cfg)
    for _ in range(2):  # the trainer has drifted from the engine and AdamW has a state
        update_step(model, opt, batch, adv, cfg)
    return cfg, model, opt, batch, adv


def _reference(model, opt, batch, adv, cfg, params):
    """batch_mask on its own forward (not shared), with the settings the mode implies."""
    return batch_mask(model, batch.sequences, batch.attention_mask, batch.rollout, adv, params=params, optimizer=opt,
                      divergence="topk_tv" if cfg.loss.mode.endswith("tv") else "topk_kl",
                      scope="all" if "-all-" in cfg.loss.mode else "region", thresholds=cfg.loss.thresholds,
                      sampling=cfg.loss.sampling, is_cap=cfg.loss.corrections.is_cap)


@pytest.mark.parametrize("params", ["all", "1"])
@pytest.mark.parametrize("mode", BATCH_MODES)
@pytest.mark.usefixtures("one_thread")  # bitwise phi: the shared forward is the same forward, on one thread
def test_the_loss_applies_batch_masks_mask_on_the_shared_forward(setup, mode, params):
    cfg0, model0, opt0, batch, adv = setup
    # a delta below the drift, so O holds tokens of both directions
    cfg = replace(cfg0, mode=mode, batch_params=params, delta_low=2e-3, delta_high=2e-3)
    model, opt = copy.deepcopy(model0), None
    opt = make_optimizer(model, cfg)
    opt.load_state_dict(copy.deepcopy(opt0.state_dict()))
    out = compute_loss(model, batch, adv, cfg, optimizer=opt)
    ref = _reference(model, opt, batch, adv, cfg, "all" if params == "all" else int(params))
    assert torch.equal(out.mask, ref.mask)
    torch.testing.assert_close(out.stats["ddot_batch"].reshape(ref.ddot.shape), ref.ddot, rtol=1e-5, atol=1e-6)
    n_out, n_masked = int(ref.metrics["num_out_of_region"]), int(ref.metrics["num_masked"])
    if "-all-" in mode:
        assert 0 < n_masked < int(ref.metrics["num_tokens"])
    else:
        assert 0 < n_masked < n_out  # the direction test decides: some of O kept, some masked
    assert out.metrics["batch_phi"] == ref.metrics["phi"]
    # the shared forward's gradient is the ordinary one (the tied matrix through both uses)
    out.loss.backward()
    plain = copy.deepcopy(model0)
    logits = response_logits(plain, batch.sequences, batch.attention_mask, batch.prompt_len)
    pdmask.policy_loss(logits, batch.rollout, adv, corrections=cfg.loss.corrections,
                       sampling=cfg.loss.sampling, **ref.loss_kwargs()).loss.backward()
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)


def test_update_step_uses_the_optimizer_state_before_its_own_step(setup):
    """The direction's preconditioner is the state of the step it predicts: the mask and
    the parameters after update_step equal batch_mask with the pre-step AdamW + that step."""
    cfg0, model0, opt0, batch, adv = setup
    cfg = replace(cfg0, mode="pdm-batch-topk-kl", delta_low=2e-3, delta_high=2e-3)
    a, b = copy.deepcopy(model0), copy.deepcopy(model0)
    opt_a, opt_b = make_optimizer(a, cfg), make_optimizer(b, cfg)
    opt_a.load_state_dict(copy.deepcopy(opt0.state_dict()))
    opt_b.load_state_dict(copy.deepcopy(opt0.state_dict()))
    out, _ = update_step(a, opt_a, batch, adv, cfg)
    ref = _reference(b, opt_b, batch, adv, cfg, "all")
    assert torch.equal(out.mask, ref.mask) and int(ref.metrics["num_masked"]) > 0
    logits = response_logits(b, batch.sequences, batch.attention_mask, batch.prompt_len)
    pdmask.policy_loss(logits, batch.rollout, adv, corrections=cfg.loss.corrections,
                       sampling=cfg.loss.sampling, **ref.loss_kwargs()).loss.backward()
    torch.nn.utils.clip_grad_norm_(b.parameters(), cfg.grad_clip)
    opt_b.step()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-7, msg=n)


def test_batch_modes_need_the_optimizer_and_valid_settings(setup):
    cfg0, model, _, batch, adv = setup
    cfg = replace(cfg0, mode="pdm-batch-topk-kl")
    with pytest.raises(ValueError, match=r"^optimizer: mode 'pdm-batch-topk-kl' needs the optimizer"):
        compute_loss(model, batch, adv, cfg)
    for over, msg in [("batch_params=0", "batch_params: expected all or a number of last blocks >= 1, got '0'"),
                      ("batch_params=last", "batch_params: expected all or a number"),
                      ("batch_params=3", "batch_params: the model has num_layers=2 blocks, got 3"),
                      ("batch_method=fwd", "batch_method: unknown value 'fwd'; valid values are: auto, jvp, "
                                           "double-backward")]:
        with pytest.raises(ValueError, match="^" + msg.replace("(", r"\(").replace(")", r"\)")):
            load_config(None, TINY + [over])
    assert load_config(None, TINY + ["batch_params=2"]).batch_params == "2"  # YAML int -> the field's str


def _smoke(smoke_config, cache_dir, out_dir, **over):
    base = load_config(smoke_config, [f"cache_dir={cache_dir}", f"out_dir={out_dir}", "progress=false",
                                      "tensorboard=false"])
    return replace(base, **over)


@pytest.mark.parametrize("mode,params", [(m, "all") for m in BATCH_MODES] + [("pdm-batch-topk-kl", "1")])
def test_each_batch_mode_trains_end_to_end(tmp_path, cache_dir, smoke_config, mode, params):
    cfg = _smoke(smoke_config, cache_dir, tmp_path, mode=mode, batch_params=params, steps=2, eval_every=2,
                 delta_low=0.01, delta_high=0.01)
    summary = train(cfg)
    recs = read_jsonl(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in recs] == [0, 1, 2] and summary["mode"] == mode
    for r in recs[1:]:
        for k in ("loss", "grad_norm", "batch_phi", "batch_direction_norm", "batch_outward_frac_out_of_region"):
            assert r[k] == r[k], k  # present and not NaN
    assert sum(r["num_out_of_region"] for r in recs[1:]) > 0 and any(r["grad_norm"] > 0 for r in recs[1:])


def test_a_batch_mode_run_resumes_to_the_uninterrupted_run(tmp_path, cache_dir, smoke_config):
    """Stopped after its step-2 checkpoint and resumed, a batch-mode run logs exactly the
    records of the run that never stopped (the optimizer state, hence P, is restored)."""
    over = dict(mode="pdm-batch-topk-kl", delta_low=0.01, delta_high=0.01, engine_precision="fp8", sync_every=2)
    full = _smoke(smoke_config, cache_dir, tmp_path / "a", steps=4, **over)
    train(full)
    train(_smoke(smoke_config, cache_dir, tmp_path / "b", steps=2, **over))
    train(_smoke(smoke_config, cache_dir, tmp_path / "b", steps=4, **over), resume=True)

    def strip(recs):
        return [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in recs]

    ref = read_jsonl(tmp_path / "a" / "smoke" / "metrics.jsonl")
    got = read_jsonl(tmp_path / "b" / "smoke" / "metrics.jsonl")
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4]
    assert sum(r["masked_frac"] for r in ref[1:]) > 0  # the batch mask was active
    assert strip(got) == strip(ref)
