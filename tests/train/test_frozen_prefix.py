"""``frozen_prefix_cache`` (issue 44, item 2): the frozen blocks' hidden states computed once per
step and reused by the anchor forward and the updates.

- bit for bit: on the slices the step's first pass ran on, the cached forward's loss, metrics,
  gradients and pi_old equal the whole forward's (both anchors, logits and hidden-state loss,
  Llama and Qwen3; one thread, the same operations in the same order);
- float rounding: another slice of the same rows (``always``, a later epoch) reads hidden states
  computed in a batch of another shape; the premise (positions count real tokens, padding is
  masked) and the loss and gradients are checked at dtype-aware tolerances;
- a trainer run with the cache writes the same metrics as one without;
- one line naming ``frozen_prefix_cache`` for a bad value, ``always`` where nothing is cached, a
  model with dropout, a model whose forward cannot start at the first trained block.
"""

from __future__ import annotations

import copy

import pytest
import torch

from pdmask.engine.hf import response_logits, sample
from pdmask_lab.audit.steps import copy_in
from pdmask.train.config import load_config
from pdmask.train.frozen_prefix import prefix_hidden, recording, skipping, step_start
from pdmask.train.model import build_model
from pdmask.train.trainable import apply_variant, decoder_parts
from pdmask.train.update import compute_loss, select
from tests.numerics import one_thread

V = 97
TINY = ["hidden_size=32", "num_layers=3", "num_heads=4", "intermediate_size=64", "top_k=5", "prompts_per_step=3",
        "group_size=2", "minibatches=3", "train_blocks=2"]


def cfg_of(*over):
    return load_config(None, TINY + list(over))


def model_of(cfg, dtype=torch.float32):
    m = build_model(cfg, V, pad_id=0, eos_id=1, seed=0)
    with torch.no_grad():
        m.lm_head.weight.mul_(3.0)  # logits spread enough for a non-trivial loss
    m = copy_in(m, dtype) if dtype == torch.float64 else m
    return apply_variant(m, cfg).train()


def rollout(model, seed=0):
    """Six rollouts of prompts of four lengths (left padding) that end at different steps (right
    padding), and advantages of both signs."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [5, 6, 7], [20, 21, 22, 23], [8, 9]]
    m32 = copy.deepcopy(model).float()
    b = sample(m32, prompts, max_new_tokens=7, eos_id=1, pad_id=0, top_k_logprobs=5, seed=seed)
    return b, torch.tensor([1.0, -0.7, 0.4, -1.2, 0.9, -0.3])


def lengths(b):
    return b.attention_mask[:, :b.prompt_len].sum(1).tolist(), b.response_mask.sum(1).tolist()


def losses_and_grads(model, b, adv, cfg, perm, mb, cached: bool, slices=None):
    """(pi_old, [(loss, metrics, grads)] per mini-batch) of one step's first pass and its updates
    (each mini-batch's gradient at the same weights, no optimizer step)."""
    c = cfg if cached else load_config(None, TINY + ["frozen_prefix_cache=never"] + _extra(cfg))
    plens, rlens = lengths(b)
    anchor, prefix = step_start(model, b, adv, perm, mb, select, plens, rlens, c, check=cached)
    assert (prefix is not None) == cached
    out = []
    for idx in slices or [perm[j * mb:(j + 1) * mb] for j in range(len(perm) // mb)]:
        sub = select(b, idx, plens, rlens)
        rows = None if prefix is None else prefix.rows(idx, sub, b.prompt_len)
        o = compute_loss(model, sub, adv[idx], c, anchor=None if anchor is None else anchor.rows(idx, sub),
                         prefix=rows)
        model.zero_grad(set_to_none=True)
        o.loss.backward()
        out.append((o.loss.detach(), {k: v.detach() for k, v in o.metrics.items()},
                    [p.grad.clone() for p in model.parameters() if p.requires_grad]))
    return anchor, out


def _extra(cfg):
    return [f"loss.anchor={cfg.loss.anchor}", f"loss_from={cfg.loss_from}", f"arch={cfg.arch}"]


def _equal_steps(a, b):
    for (la, ma, ga), (lb, mb_, gb) in zip(a, b, strict=True):
        assert torch.equal(la, lb)
        assert ma.keys() == mb_.keys() and all(torch.equal(ma[k], mb_[k]) for k in ma), \
            [k for k in ma if not torch.equal(ma[k], mb_[k])]
        assert len(ga) == len(gb) > 0 and all(torch.equal(x, y) for x, y in zip(ga, gb))
        assert any(bool(g.abs().sum() > 0) for g in ga)


# ---------------------------------------------------------------- bit for bit
@pytest.mark.parametrize("anchor,loss_from,arch", [("old", "logits", "llama"), ("rollout", "logits", "llama"),
                                                   ("old", "hidden", "llama"), ("old", "logits", "qwen3")])
def test_the_cached_step_is_the_plain_step_bit_for_bit(anchor, loss_from, arch):
    cfg = cfg_of(f"loss.anchor={anchor}", f"loss_from={loss_from}", f"arch={arch}")
    model = model_of(cfg)
    b, adv = rollout(model)
    perm = [4, 0, 2, 5, 1, 3]
    with one_thread():
        a_plain, plain = losses_and_grads(model, b, adv, cfg, perm, 2, cached=False)
        a_cached, cached = losses_and_grads(model, b, adv, cfg, perm, 2, cached=True)
    _equal_steps(cached, plain)
    if anchor == "old":  # pi_old comes from the same forward that fills the cache
        assert torch.equal(a_cached.logprob, a_plain.logprob) and torch.equal(a_cached.topk, a_plain.topk)
        assert torch.equal(a_cached.distance, a_plain.distance)
    else:
        assert a_cached is None and a_plain is None


def test_the_prefix_is_what_enters_the_first_trained_block_and_skipping_restores_the_blocks():
    cfg = cfg_of()
    model = model_of(cfg)
    b, _ = rollout(model)
    blocks, _, _ = decoder_parts(model)
    seen = []
    with torch.no_grad(), recording(blocks[1], seen, stop=False):
        whole = response_logits(model, b.sequences, b.attention_mask, b.prompt_len)
    assert len(seen) == 1 and seen[0].shape == (6, b.sequences.shape[1] - 1, 32)
    with torch.no_grad(), skipping(list(blocks)[:1]):
        again = response_logits(model, b.sequences, b.attention_mask, b.prompt_len, inputs_embeds=seen[0])
    assert torch.equal(again, whole)
    assert "forward" not in vars(blocks[0])  # the block's own forward is back
    with torch.no_grad():
        assert torch.equal(response_logits(model, b.sequences, b.attention_mask, b.prompt_len), whole)


# ---------------------------------------------------------------- float rounding
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_the_slice_of_the_whole_batchs_prefix_is_a_mini_batchs_own_prefix(dtype, rtol):
    """Positions count real tokens and padding is masked: a mini-batch's trimmed rows and columns
    see, at its real tokens, the hidden states the whole batch saw there."""
    cfg = cfg_of()
    model = model_of(cfg, dtype)
    b, _ = rollout(model)
    plens, rlens = lengths(b)
    blocks, _, _ = decoder_parts(model)
    idx = [4, 1]  # not the longest prompt: the columns are trimmed
    sub = select(b, idx, plens, rlens)
    whole, own = prefix_hidden(model, blocks[1], b), prefix_hidden(model, blocks[1], sub)
    p0 = b.prompt_len - sub.prompt_len
    assert p0 > 0 and own.shape[1] < whole.shape[1]  # the mini-batch is trimmed
    cut = whole[idx, p0:p0 + own.shape[1]]
    real = sub.attention_mask[:, :-1].bool()
    assert (~real).sum() > 0  # padding inside the mini-batch too
    x, y = cut[real], own[real]
    assert torch.allclose(x, y, rtol=rtol, atol=rtol * y.abs().max().item())
    assert not torch.equal(x, torch.zeros_like(x))


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
def test_always_reads_the_prefix_for_other_slices_equal_to_float_rounding(dtype, rtol):
    """A later epoch's mini-batches (rows from several first-epoch mini-batches) with the cache
    (``always``) against the whole forward: loss, metrics and gradients to the dtype's rounding."""
    cfg = cfg_of("loss.anchor=old", "frozen_prefix_cache=always", "epochs=2")
    model = model_of(cfg, dtype)
    b, adv = rollout(model)
    perm, later = [4, 0, 2, 5, 1, 3], [[1, 4], [3, 0], [5, 2]]
    _, plain = losses_and_grads(model, b, adv, cfg, perm, 2, cached=False, slices=later)
    _, cached = losses_and_grads(model, b, adv, cfg, perm, 2, cached=True, slices=later)
    for (la, ma, ga), (lb, _, gb) in zip(cached, plain, strict=True):
        assert torch.allclose(la, lb, rtol=rtol, atol=rtol * lb.abs().item())
        for x, y in zip(ga, gb, strict=True):
            assert torch.allclose(x, y, rtol=rtol, atol=rtol * y.abs().max().item())
        assert ma.keys() == _.keys()


def test_auto_runs_the_whole_forward_on_a_slice_the_pass_did_not_run_on():
    cfg = cfg_of("loss.anchor=old", "epochs=2")
    model = model_of(cfg)
    b, adv = rollout(model)
    plens, rlens = lengths(b)
    _, prefix = step_start(model, b, adv, [4, 0, 2, 5, 1, 3], 2, select, plens, rlens, cfg)
    assert prefix.rows([4, 0], select(b, [4, 0], plens, rlens), b.prompt_len) is not None
    assert prefix.rows([1, 4], select(b, [1, 4], plens, rlens), b.prompt_len) is None
    always = cfg_of("loss.anchor=old", "epochs=2", "frozen_prefix_cache=always")
    _, prefix = step_start(model, b, adv, [4, 0, 2, 5, 1, 3], 2, select, plens, rlens, always)
    assert prefix.rows([1, 4], select(b, [1, 4], plens, rlens), b.prompt_len) is not None


# ---------------------------------------------------------------- the trainer
def test_a_run_with_the_cache_writes_the_metrics_of_a_run_without(tmp_path, cache_dir, smoke_config, cli):
    from pdmask.train.grpo import TIME_KEYS
    from pdmask.train.logging import read_jsonl

    run_cli, _ = cli
    recs = {}
    for value in ("auto", "never"):
        (tmp_path / value).mkdir()
        run_cli(["train", "--config", smoke_config, f"cache_dir={cache_dir}", f"out_dir={tmp_path / value}",
                 "progress=false", "steps=2", "eval_every=2", "num_layers=2", "train_blocks=1", "anchor=old",
                 f"frozen_prefix_cache={value}", "threads=1"], cwd=tmp_path)
        recs[value] = [{k: v for k, v in r.items() if k not in TIME_KEYS}
                       for r in read_jsonl(tmp_path / value / "smoke" / "metrics.jsonl")]
    assert len(recs["auto"]) == 3 and recs["auto"] == recs["never"]


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize("over,msg", [
    (["frozen_prefix_cache=sometimes"], "frozen_prefix_cache: unknown value 'sometimes'; valid values are: auto, "
                                        "always, never"),
    (["frozen_prefix_cache=true"], "frozen_prefix_cache: expected a string, got True: YAML reads an unquoted"),  # YAML's true is no value of it
    (["frozen_prefix_cache=always", "train_blocks=0"], "frozen_prefix_cache: always needs train_blocks >= 1"),
])
def test_bad_values_are_one_line_naming_the_key(over, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")) as e:
        load_config(None, TINY + over)
    assert "\n" not in str(e.value)


def test_always_with_a_mode_that_runs_its_own_forward_is_refused():
    pytest.importorskip("pdmask_lab.batchmask")
    with pytest.raises(ValueError, match="frozen_prefix_cache: mode 'pdm-batch-topk-kl' runs its own forward"):
        load_config(None, TINY + ["loss.mode=pdm-batch-topk-kl", "frozen_prefix_cache=always"])
    assert load_config(None, TINY + ["loss.mode=pdm-batch-topk-kl"]).frozen_prefix_cache == "auto"


def test_a_model_with_dropout_is_refused_at_the_first_step():
    cfg = cfg_of()
    model = model_of(cfg)
    model.config.attention_dropout = 0.1
    b, adv = rollout(model)
    plens, rlens = lengths(b)
    with pytest.raises(ValueError, match=r"frozen_prefix_cache: the model has dropout \(attention_dropout=0.1\)"):
        step_start(model, b, adv, list(range(6)), 2, select, plens, rlens, cfg, check=True)


def test_a_decoder_that_rescales_its_inputs_embeds_fails_the_first_steps_check():
    """A Gemma-like decoder multiplies ``inputs_embeds`` on entry: the replay would scale the
    cached hidden state again. The once-per-run check sees it."""
    cfg = cfg_of()
    model = model_of(cfg)
    b, adv = rollout(model)
    plens, rlens = lengths(b)

    def scale(module, args, kwargs):
        if kwargs.get("inputs_embeds") is not None:
            kwargs["inputs_embeds"] = kwargs["inputs_embeds"] * 2.0
        return args, kwargs

    model.get_decoder().register_forward_pre_hook(scale, with_kwargs=True)
    with pytest.raises(ValueError, match="frozen_prefix_cache: LlamaForCausalLM's forward from block 1 on the cached "
                                         "prefix is not its whole forward"):
        step_start(model, b, adv, list(range(6)), 2, select, plens, rlens, cfg, check=True)
