"""Trainable-parameter variants (train_blocks, LoRA) and loss_from=hidden in the trainer.

- gradients: top-N under freezing equal the full model's on the same parameters; LoRA's
  obey the chain rule through the merged weight (dL/dB = s G A^T, dL/dA = s B^T G, G the
  full model's gradient at W + s B A); hidden-state loss equals the logits loss (float64);
- the engine sync (merged weights) reproduces the trainer's log-probs after LoRA steps;
- resume after an injected crash with a variant equals the uninterrupted run, and a
  resume with another variant is refused;
- the audit of a LoRA run gives its engine the merged weights;
- bad values are refused in one line naming the key.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from pdmask_lab.audit.steps import copy_in
from pdmask.engine.hf import HFEngine, response_logits, sample
from pdmask.engine.registry import MissingExtra
from pdmask.train.config import load_config, replace
from pdmask.train.model import build_model
from pdmask.train.trainable import apply_variant, engine_state_dict, lora_layers, trainable_parameters
from pdmask.train.update import compute_loss, make_optimizer, update_step
from tests.numerics import sum_atol

V = 97
TINY = ["hidden_size=32", "num_layers=3", "num_heads=4", "intermediate_size=64", "top_k=5"]
LORA = ["lora_rank=4", "lora_alpha=8.0"]


def _peft():
    return pytest.importorskip("peft", reason="LoRA tests need the 'lora' extra, peft (run .ci/lora.sh)")


def cfg_of(*over):
    return load_config(None, TINY + list(over))


def base_model(dtype=torch.float64):
    """A tiny Llama (tied embeddings) with logits spread enough for a non-trivial loss.
    float64 copies compute their RMSNorm in float64 (transformers' rounds to float32), so
    equalities hold to float64 rounding."""
    m = build_model(cfg_of(), V, pad_id=0, eos_id=1, seed=0)
    with torch.no_grad():
        m.lm_head.weight.mul_(3.0)
    return copy_in(m, dtype) if dtype == torch.float64 else m


def rollout(model, seed=0):
    """A rollout of ``model`` itself (float32 sampling) and fixed nonzero advantages (B,)."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [5, 6, 7]]
    m32 = copy.deepcopy(model).float()
    batch = sample(m32, prompts, max_new_tokens=6, eos_id=1, pad_id=0, top_k_logprobs=5, seed=seed)
    return batch, torch.tensor([1.0, -0.7, 0.4, -1.2])


def _nonzero_B(model, seed=3):
    """LoRA B starts at zero (the base model); a random B makes A's gradient nonzero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))


# ---------------------------------------------------------------- gradients
@pytest.mark.parametrize("loss_from", ["logits", "hidden"])
def test_top_n_gradients_equal_the_full_models_on_the_trained_parameters(loss_from):
    base = base_model()
    batch, adv = rollout(base)
    cfg = cfg_of(f"loss_from={loss_from}", "train_blocks=2")
    full, top = copy.deepcopy(base), apply_variant(copy.deepcopy(base), cfg)
    trained = [n for n, p in top.named_parameters() if p.requires_grad]
    assert trained and all(n.startswith(("model.layers.1.", "model.layers.2.", "model.norm.")) for n in trained)
    assert len(trained) == 9 * 2 + 1  # 7 linears + 2 norms per block, the final norm
    assert not top.model.embed_tokens.weight.requires_grad and top.lm_head.weight is top.model.embed_tokens.weight
    for m in (full, top):
        compute_loss(m, batch, adv, cfg).loss.backward()
    got, want = dict(top.named_parameters()), dict(full.named_parameters())
    for n in trained:
        g = want[n].grad
        assert g.abs().max() > 1e-6, n  # the gradient is not trivially zero
        # Two graphs: the frozen blocks skip their backward, so other BLAS calls run with their
        # own summation orders (and MKL picks its kernels by CPU model), hence equal only up to
        # reordered float64 sums. The longest sum is over the V = 97 logits (the others: 64, 32,
        # 40 token rows); with max|grad| standing in for sum|terms| the bound is 2 V eps max|grad|
        # (tests/numerics.py), 194 eps; measured on an AMD EPYC: at most 3 eps max|grad|.
        torch.testing.assert_close(got[n].grad, g, rtol=0, atol=sum_atol(V, g), msg=n)
    assert all(p.grad is None for p in top.parameters() if not p.requires_grad)  # frozen: no backward there
    opt = make_optimizer(top, cfg)
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(got[n]) for n in trained]


def test_loss_from_hidden_equals_the_logits_loss_and_its_gradients():
    base = base_model()
    batch, adv = rollout(base)
    outs, grads = [], []
    for loss_from in ("logits", "hidden"):
        m = copy.deepcopy(base)
        out = compute_loss(m, batch, adv, cfg_of(f"loss_from={loss_from}"), validate=True)
        out.loss.backward()
        outs.append(out)
        grads.append({n: p.grad for n, p in m.named_parameters()})
    # two graphs (hidden states times the head vs the logits): a token mean of terms each made
    # through sums of at most V terms, so 2 V eps of the mean |term| (tests/numerics.py)
    scale = outs[0].token_loss.abs()[batch.response_mask].mean()
    torch.testing.assert_close(outs[1].loss, outs[0].loss, rtol=0, atol=sum_atol(V, scale))
    for k in ("masked_frac", "entropy_mean"):
        torch.testing.assert_close(outs[1].metrics[k], outs[0].metrics[k], rtol=1e-10, atol=1e-12)
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-10, atol=1e-13, msg=n)


def test_lora_gradients_obey_the_chain_rule_through_the_merged_weight():
    _peft()
    base = base_model()
    batch, adv = rollout(base)
    cfg = cfg_of(*LORA)
    lora = apply_variant(copy.deepcopy(base), cfg)
    _nonzero_B(lora)
    merged = copy.deepcopy(base)  # the full model at W + s B A
    merged.load_state_dict(engine_state_dict(lora))
    out_l, out_m = compute_loss(lora, batch, adv, cfg), compute_loss(merged, batch, adv, cfg)
    # two graphs (adapters beside W vs the merged W + s B A, itself rounded): a token mean of
    # terms each made through sums of at most V terms, 2 V eps of the mean |term| (tests/numerics.py)
    scale = out_m.token_loss.abs()[batch.response_mask].mean()
    torch.testing.assert_close(out_l.loss, out_m.loss, rtol=0, atol=sum_atol(V, scale))
    out_l.loss.backward()
    out_m.loss.backward()
    layers = lora_layers(lora)
    assert len(layers) == 3 * 7  # every attention and MLP linear of the 3 blocks
    assert {n for n, p in lora.named_parameters() if p.requires_grad} == \
        {f"{k}.lora_{x}.default.weight" for k in layers for x in "AB"}
    for name, mod in layers.items():
        A, B, s = mod.lora_A["default"].weight, mod.lora_B["default"].weight, mod.scaling["default"]
        assert s == 2.0  # lora_alpha / lora_rank
        G = merged.get_parameter(f"{name}.weight").grad  # dL/dW at W + s B A, (out, in)
        want_B, want_A = s * G @ A.T, s * B.T @ G
        assert want_A.abs().max() > 1e-6 and want_B.abs().max() > 1e-6, name
        torch.testing.assert_close(B.grad, want_B, rtol=1e-9, atol=1e-12 * want_B.abs().max().item(), msg=name)
        torch.testing.assert_close(A.grad, want_A, rtol=1e-9, atol=1e-12 * want_A.abs().max().item(), msg=name)


def test_lora_in_the_top_n_blocks_only():
    _peft()
    m = apply_variant(base_model(torch.float32), cfg_of(*LORA, "train_blocks=1", "lora_targets=q_proj,down_proj"))
    assert sorted(lora_layers(m)) == ["model.layers.2.mlp.down_proj", "model.layers.2.self_attn.q_proj"]
    assert len(trainable_parameters(m)) == 4 and not m.model.norm.weight.requires_grad


def test_the_batch_direction_over_lora_adapters_equals_the_per_token_loop():
    """pdm-batch-* modes with LoRA: BatchMask's params='all' (the trainable adapters)
    against the explicit per-token autograd loop over the same parameters."""
    _peft()
    from tests import flat
    from tests.batchmask.helpers import make_batch, per_token_oracle, tiny_llama

    m = apply_variant(tiny_llama(layers=2), cfg_of(*LORA, "lora_targets=q_proj,v_proj,down_proj"))
    _nonzero_B(m)
    batch = make_batch(m, seed=2)
    out = flat.batch_mask(m, **batch, method="jvp", all_tokens=True)
    ref, O, _, _ = per_token_oracle(m, batch, trainable_parameters(m))
    assert O.any() and ref.abs().max() > 1e-2
    # transformers' RMSNorm rounds to float32 in this float64 model (as in test_batch_mask)
    torch.testing.assert_close(out.ddot, ref, atol=1e-6 * ref.abs().max().item(), rtol=1e-5)


# ---------------------------------------------------------------- engine sync
@pytest.mark.parametrize("variant", [["train_blocks=2"], LORA, LORA + ["train_blocks=2"]])
def test_engine_sync_reproduces_the_trainers_logprobs_after_steps(variant):
    if any(v.startswith("lora") for v in variant):
        _peft()
    cfg = cfg_of(*variant, "lr=0.02", "temperature=0.9")
    model = base_model(torch.float32)
    engine = HFEngine(model, eos_id=1, pad_id=0, precision="fp32", temperature=0.9, top_k_logprobs=5)
    apply_variant(model, cfg)
    opt = make_optimizer(model, cfg)
    for step in range(3):  # the trainer moves; the engine keeps the base weights
        batch = engine.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]] * 2, max_new_tokens=6, seed=step)
        update_step(model, opt, batch, torch.tensor([1.0, -0.7, 0.4, -1.2, 0.8, -0.3]), cfg)
    if any(v.startswith("lora") for v in variant):
        assert all(p.abs().max() > 1e-3 for n, p in model.named_parameters() if ".lora_B." in n)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = engine.generate([[5, 6, 7], [10, 11, 12, 13]], max_new_tokens=6, seed=9)
    m = batch.response_mask

    def gap():
        with torch.no_grad():
            mine = torch.log_softmax(response_logits(model, batch.sequences, batch.attention_mask,
                                                     batch.prompt_len) / 0.9, -1)
        theirs = torch.log_softmax(engine.score(batch.sequences, batch.attention_mask, batch.prompt_len) / 0.9, -1)
        return (mine - theirs)[m].abs().max().item()

    assert gap() > 1e-3  # the trainer really moved away from the engine
    sd = engine_state_dict(model)
    assert set(sd) == set(engine.model.state_dict())  # the base model's names, no adapter keys
    engine.load_weights(sd)
    assert gap() < 1e-5
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # the merge did not touch the trainer


def test_the_hf_engine_refuses_a_lora_models_own_state_dict():
    _peft()
    model = base_model(torch.float32)
    engine = HFEngine(model, eos_id=1, pad_id=0, precision="fp32")
    apply_variant(model, cfg_of(*LORA))
    with pytest.raises(ValueError, match=r"^state_dict: does not fit .*base_layer.*LoRA adapters\? merge them first"):
        engine.load_weights(model.state_dict())


# ---------------------------------------------------------------- resume
def _records(run_dir):
    from pdmask.train.grpo import TIME_KEYS
    from pdmask.train.logging import read_jsonl

    return [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in read_jsonl(run_dir / "metrics.jsonl")]


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.mark.parametrize("variant", [["train_blocks=1"], LORA + ["train_blocks=1", "loss_from=hidden"]])
def test_resume_after_a_crash_with_the_variant_equals_the_uninterrupted_run(variant, tmp_path, cache_dir,
                                                                          smoke_config, monkeypatch):
    if any(v.startswith("lora") for v in variant):
        _peft()
    from pdmask.train import grpo

    common = [f"cache_dir={cache_dir}", "progress=false", "tensorboard=false", "steps=6", "checkpoint_every=2",
              "minibatches=2", *variant]
    cfg_a = load_config(smoke_config, common + [f"out_dir={tmp_path / 'a'}"])
    cfg_b = load_config(smoke_config, common + [f"out_dir={tmp_path / 'b'}"])
    grpo.train(cfg_a)
    save = grpo.save_checkpoint

    def crash_at_6(run_dir, *, step, **kw):  # steps 5 and 6 are logged, the last checkpoint is step 4
        if step == 6:
            raise RuntimeError("injected crash")
        return save(run_dir, step=step, **kw)

    monkeypatch.setattr(grpo, "save_checkpoint", crash_at_6)
    with pytest.raises(RuntimeError, match="injected crash"):
        grpo.train(cfg_b)
    monkeypatch.undo()
    assert [r["step"] for r in _records(cfg_b.run_dir)] == list(range(7))
    assert sorted(p.name for p in (cfg_b.run_dir / "checkpoints").glob("step-*")) == ["step-000002", "step-000004"]
    # another variant cannot resume it (its frozen set or adapters differ): one line, the key named
    with pytest.raises(ValueError, match=r"^train_blocks: checkpoint step-000004 was written with train_blocks=1, "
                                         r"this run has train_blocks=0; resume with the settings") as e:
        grpo.train(replace(cfg_b, train_blocks=0), resume=True)
    assert "\n" not in str(e.value)
    grpo.train(cfg_b, resume=True)
    ref, got = _records(cfg_a.run_dir), _records(cfg_b.run_dir)
    assert [r["step"] for r in got] == list(range(7)) and got == ref
    assert sum(r["grad_norm"] > 0 for r in ref[5:]) >= 1  # real updates after the crash point
    assert ref[0]["num_trainable_params"] < ref[0]["num_params"]
    a, b = (r.run_dir / "checkpoints" / "step-000006" for r in (cfg_a, cfg_b))
    for name in ("model.safetensors", "engine.safetensors", "optimizer.safetensors"):
        ta, tb = _tensors(a / name), _tensors(b / name)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), name
    from pdmask.train.checkpoint import load_optimizer_state

    n_trainable = ref[0]["num_trainable_params"]
    state = load_optimizer_state(b)["state"]  # AdamW moments of the trained parameters only
    assert sum(s["exp_avg"].numel() for s in state.values()) == n_trainable


def test_the_audit_of_a_lora_run_gives_its_engine_the_merged_weights(tmp_path, cache_dir, smoke_config):
    """A run directory of a LoRA run, audited with another engine precision (fp32): the
    engine is synced from the policy (merged), so its log-probs are the policy's."""
    _peft()
    from pdmask_lab.audit.source import build_source
    from pdmask.train.grpo import train

    cfg = load_config(smoke_config, [f"cache_dir={cache_dir}", f"out_dir={tmp_path}", "progress=false",
                                     "tensorboard=false", "steps=2", "lr=0.05", *LORA])
    train(cfg)
    tcfg = load_config(cfg.run_dir / "config.yaml", ["engine_precision=fp32"])
    src = build_source(tcfg, model=str(cfg.run_dir))
    assert src.info["engine_weights"].startswith("the checkpoint's trainer weights at fp32")
    assert src.info["optimizer_state"] == "the run's AdamW state"
    assert any(".lora_B." in n and p.abs().max() > 0 for n, p in src.model.named_parameters())
    batch, _, _ = src.sample(0)
    with torch.no_grad():
        mine = torch.log_softmax(src.forward(src.model, batch.sequences, batch.attention_mask, batch.prompt_len), -1)
    theirs = torch.log_softmax(src.engine.score(batch.sequences, batch.attention_mask, batch.prompt_len), -1)
    m = batch.response_mask
    # two float32 graphs (adapters beside W vs the merged W + s B A, rounded once): equal up to
    # their sums' rounding, at most 2 n eps32 of the values' size with n the longest sum (the
    # MLP's intermediate_size); measured on an AMD EPYC: 10 eps32 max|log-prob|. Without the
    # merged adapters the gap is 8.8, so the check still tells merged from not.
    n = max(cfg.hidden_size, cfg.intermediate_size)
    tol = 2 * n * torch.finfo(torch.float32).eps * mine[m].abs().max().item()
    assert (mine - theirs)[m].abs().max() < tol


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("over,msg", [
    (["train_blocks=-1"], "train_blocks: must be >= 0"),
    (["train_blocks=5"], "train_blocks: the model has num_layers=3 blocks, got 5"),
    (["lora_rank=-2"], "lora_rank: must be >= 0"),
    (["lora_rank=4", "lora_alpha=0"], "lora_alpha: must be a finite number > 0"),
    (["lora_rank=4", "lora_alpha=.inf"], "lora_alpha: must be a finite number > 0"),
    (["lora_alpha=8"], "lora_alpha: applies with lora_rank >= 1 only"),
    (["lora_targets=q_proj"], "lora_targets: applies with lora_rank >= 1 only"),
    (["lora_rank=4", "lora_targets=q_proj,,v_proj"], "lora_targets: expected comma-separated module names"),
    (["lora_rank=4", "lora_targets=q_proj,q_proj"], "lora_targets: names a module twice"),
    (["loss_from=both"], "loss_from: unknown value 'both'; valid values are: logits, hidden"),
    (["loss_from=hidden", "full_logits=true"], "loss_from: hidden takes no rollout logits"),
    (["loss_from=hidden", "full_logits=true", "mode=pdm-full-kl"], "loss_from: hidden takes no rollout logits"),
    (["loss_from=hidden", "mode=pdm-batch-topk-kl"], "loss_from: mode 'pdm-batch-topk-kl' computes its ddot_batch"),
])
def test_bad_values_are_one_line_naming_the_key(over, msg):
    with pytest.raises(ValueError) as e:
        cfg_of(*over)
    assert str(e.value).startswith(msg) and "\n" not in str(e.value)


def test_setup_time_errors_name_the_key():
    _peft()
    m = base_model(torch.float32)
    with pytest.raises(ValueError, match=r"^lora_targets: 'qkv' names no linear layer in the adapted blocks of "
                                         r"LlamaForCausalLM \(they have: down_proj, gate_proj, k_proj"):
        apply_variant(copy.deepcopy(m), cfg_of(*LORA, "lora_targets=q_proj,qkv"))
    over = replace(cfg_of(), num_layers=8, train_blocks=4)  # the config thinks 8 blocks, the model has 3
    with pytest.raises(ValueError, match=r"^train_blocks: LlamaForCausalLM has 3 decoder blocks, got 4$"):
        apply_variant(copy.deepcopy(m), over)
    from pdmask.train.update import lm_head_weight

    biased = copy.deepcopy(m)
    biased.lm_head = torch.nn.Linear(32, V, bias=True)
    with pytest.raises(ValueError, match=r"^loss_from: hidden needs an LM head that is a plain h @ W.T; "
                                         r"LlamaForCausalLM's has a bias; use loss_from=logits$"):
        lm_head_weight(biased)


def test_missing_peft_is_one_line_naming_the_extra(monkeypatch, tmp_path, smoke_config, cache_dir):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    from pdmask.train.preflight import check_environment

    with pytest.raises(MissingExtra, match=r"^lora_rank: LoRA needs peft, the 'lora' extra: "
                                           r"pip install -e '\.\[lora\]' from a pdmask checkout") as e:
        check_environment(cfg_of(*LORA))
    assert e.value.extra == "lora"
    pytest.importorskip("typer")
    from typer.testing import CliRunner

    from pdmask.cli import app

    r = CliRunner().invoke(app, ["train", "--config", str(smoke_config), f"cache_dir={cache_dir}",
                                 f"out_dir={tmp_path}", "lora_rank=4"])
    assert r.exit_code == 2 and r.stderr.startswith("error: lora_rank: LoRA needs peft") and r.stderr.count("\n") == 1
    assert not (tmp_path / "smoke" / "metrics.jsonl").exists()  # refused before any work (the lock file aside)
