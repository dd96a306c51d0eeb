"""The trainer's seams shared by the loop and the audit: build_engine, rollout_step,
update_step, step_metrics and checkpoint.load_weights."""

import copy
from types import SimpleNamespace

import pytest
import torch

import pdmask

from pdmask.engine import build_engine
from pdmask.engine.hf import HFEngine
from pdmask.train.checkpoint import is_run_dir, load_checkpoint, load_weights, save_checkpoint
from pdmask.train.config import load_config
from pdmask.train.grpo import step_metrics
from pdmask.train.model import build_model
from pdmask.train.rollout import decode_responses, group_advantages, rewards_for, rollout_step
from pdmask.train.update import compute_loss, make_optimizer, update_step

TINY = ["hidden_size=32", "num_layers=2", "num_heads=4", "intermediate_size=64", "temperature=0.8", "top_k=7"]


class Tok:
    """The two ids and the decode the trainer needs of a tokenizer."""

    eos_token_id, pad_token_id = 1, 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def odd_count(text: str, answer: str) -> float:
    """1 if the response has an odd number of tokens equal to ``answer`` mod 2."""
    return float(len(text.split()) % 2 == int(answer))


@pytest.fixture(scope="module")
def parts():
    cfg = load_config(None, TINY)
    model = build_model(cfg, 97, pad_id=0, eos_id=1, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    return cfg, model


def _prompts():
    return [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def test_build_engine_reads_the_config(parts):
    cfg, model = parts
    eng = build_engine(load_config(None, TINY + ["engine_precision=bf16"]), model, Tok())
    assert isinstance(eng, HFEngine)
    assert (eng.precision, eng.temperature, eng.top_k_logprobs, eng.eos_id, eng.pad_id) == ("bf16", 0.8, 7, 1, 0)
    assert next(eng.model.parameters()).dtype == torch.bfloat16
    # any object with the engine fields and a loss's sampling will do (no TrainConfig needed)
    fields = SimpleNamespace(engine="nope", engine_precision="fp32", top_k=3,
                             loss=SimpleNamespace(sampling=pdmask.Sampling(temperature=1.0)))
    with pytest.raises(ValueError, match="engine: unknown value 'nope'; valid values are: hf"):
        build_engine(fields, model, Tok())


def test_rollout_step_is_generate_rewards_advantages(parts):
    cfg, model = parts
    eng = build_engine(cfg, model, Tok())
    G, prompts, answers = 4, _prompts(), ["1", "0", "1"]
    ro = rollout_step(eng, Tok(), prompts, answers, odd_count, group_size=G, max_new_tokens=9, seed=5,
                      std_norm=True, return_logits=True)
    b = ro.batch
    assert b.sequences.shape[0] == len(prompts) * G and b.rollout.logits is not None
    for i, p in enumerate(prompts):  # group i: G consecutive copies of prompt i
        for j in range(G):
            assert b.sequences[i * G + j, b.prompt_len - len(p):b.prompt_len].tolist() == p
    # the same three steps by hand, from the same seed
    ref = eng.generate([p for p in prompts for _ in range(G)], max_new_tokens=9, seed=5)
    assert torch.equal(ref.sequences, b.sequences)
    r = rewards_for(decode_responses(Tok(), ref), [a for a in answers for _ in range(G)], odd_count)
    assert torch.equal(ro.rewards, r) and 0 < r.sum() < r.numel()  # both rewards occur
    assert torch.equal(ro.advantages, group_advantages(r, G, std_norm=True))
    m = ro.metrics
    assert m["reward"] == r.mean() and m["train_accuracy"] == (r > 0.5).float().mean()
    assert m["zero_adv_frac"] == (ro.advantages == 0).float().mean()
    assert torch.isclose(m["response_length"], b.response_mask.sum().float() / (len(prompts) * G))
    flat = [float(g.min() == g.max()) for g in r.reshape(-1, G)]
    assert ro.flat_group_frac == sum(flat) / len(flat)
    with pytest.raises(ValueError, match="answers: expected one per prompt"):
        rollout_step(eng, Tok(), prompts, answers[:2], odd_count, group_size=G, max_new_tokens=3, seed=0)


def test_rollout_step_logs_the_share_of_answers_that_end(parts):
    cfg, model0 = parts
    model = copy.deepcopy(model0)
    with torch.no_grad():  # make EOS (id 1) likely, so that some responses end and some do not
        model.lm_head.weight[1] = model.lm_head.weight.mean(0) + 0.05 * model.lm_head.weight[1]
        model.model.norm.weight.fill_(1.0)
    ro = rollout_step(build_engine(cfg, model, Tok()), Tok(), _prompts(), ["1", "0", "1"], odd_count, group_size=4,
                      max_new_tokens=9, seed=5)
    b = ro.batch
    ended = [1 in [t for t, k in zip(row, mk) if k] for row, mk in zip(b.response_ids.tolist(), b.response_mask.tolist())]
    assert 0 < sum(ended) < len(ended)  # both kinds occur, so the rate can be wrong either way
    assert ro.metrics["finish_rate"] == sum(ended) / len(ended)


@pytest.mark.parametrize("grad_clip", [1e-3, 0.0])
@pytest.mark.usefixtures("one_thread")  # bitwise loss: update_step calls compute_loss, the same ops, on one thread
def test_update_step_is_loss_backward_clip_step(parts, grad_clip):
    cfg0, model0 = parts
    cfg = load_config(None, TINY + [f"grad_clip={grad_clip}", "lr=1e-2"])
    eng = build_engine(cfg, model0, Tok())
    ro = rollout_step(eng, Tok(), _prompts(), ["1", "0", "1"], odd_count, group_size=4, max_new_tokens=6, seed=1)
    adv = torch.linspace(-1.5, 1.5, 12)  # (B,) non-zero, whatever the rewards were
    a, b = copy.deepcopy(model0), copy.deepcopy(model0)
    opt_a, opt_b = make_optimizer(a, cfg), make_optimizer(b, cfg)
    assert opt_a.defaults["betas"] == (0.9, 0.99) and opt_a.defaults["lr"] == 1e-2
    out, gn = update_step(a, opt_a, ro.batch, adv, cfg)
    # by hand
    ref = compute_loss(b, ro.batch, adv, cfg)
    ref.loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in b.parameters() if p.grad is not None]))
    if grad_clip > 0:
        assert norm > grad_clip  # the clip is active in this case
        for p in b.parameters():
            if p.grad is not None:
                p.grad.mul_(grad_clip / (norm + 1e-6))
    opt_b.step()
    torch.testing.assert_close(gn, norm, rtol=1e-6, atol=0)
    assert not gn.requires_grad and out.loss.detach() == ref.loss.detach()
    for (n, pa), pb, p0 in zip(a.named_parameters(), b.parameters(), model0.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-8, msg=n)
    assert any(not torch.equal(pa, p0) for pa, p0 in zip(a.parameters(), model0.parameters()))


def test_step_metrics_sums_counts_and_averages_the_rest(parts):
    cfg, model = parts
    eng = build_engine(cfg, model, Tok())
    ro = rollout_step(eng, Tok(), _prompts(), ["1", "0", "1"], odd_count, group_size=2, max_new_tokens=4, seed=2)
    t = torch.tensor
    rec = step_metrics(ro, [t(1.0), t(3.0)], {"mismatch_topk_kl": t(0.25)},
                       [{"loss": t(1.0), "num_tokens": t(5)}, {"loss": t(2.0), "num_tokens": t(7)}])
    assert list(rec)[:7] == ["reward", "train_accuracy", "response_length", "zero_adv_frac", "finish_rate",
                             "grad_norm", "mismatch_topk_kl"]
    assert rec["grad_norm"] == 2.0 and rec["loss"] == 1.5 and rec["num_tokens"] == 12.0
    assert rec["mismatch_topk_kl"] == 0.25 and rec["reward"] == pytest.approx(float(ro.rewards.mean()))
    assert all(isinstance(v, float) for v in rec.values())


def test_load_weights_restores_and_says_what(parts, tmp_path):
    cfg, model0 = parts
    model, other = copy.deepcopy(model0), copy.deepcopy(model0)
    eng = build_engine(load_config(None, TINY + ["engine_precision=fp8"]), model, Tok())
    opt = make_optimizer(model, cfg)
    model(torch.tensor([[3, 4, 5]])).logits.sum().backward()
    opt.step()  # moves the weights and fills the AdamW state
    ck = save_checkpoint(tmp_path / "run", step=1, model=model, optimizer=opt, engine=eng)
    (tmp_path / "run" / "config.yaml").write_text("name: run\n")
    assert is_run_dir(tmp_path / "run") and not is_run_dir(ck)

    eng2 = build_engine(load_config(None, TINY + ["engine_precision=fp8"]), other, Tok())
    eng2.load_weights({k: v + 1 for k, v in other.state_dict().items()})  # differs from the saved engine
    opt2 = make_optimizer(other, cfg)
    done = load_weights(ck, other, engine=eng2, optimizer=opt2)
    assert done == {"model": True, "engine": True, "optimizer": True}
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k
    for k, v in eng.state_dict().items():
        assert torch.equal(eng2.state_dict()[k], v), k
    st = opt2.state_dict()["state"]
    assert st and all(torch.equal(st[i]["exp_avg"], opt.state_dict()["state"][i]["exp_avg"]) for i in st)

    # only what is given and present is restored, and the answer says so
    (ck / "engine.safetensors").unlink()
    before = eng2.state_dict()
    assert load_weights(ck, copy.deepcopy(model0), engine=eng2) == {"model": True, "engine": False,
                                                                     "optimizer": False}
    assert all(torch.equal(eng2.state_dict()[k], v) for k, v in before.items())
    (ck / "optimizer.safetensors").unlink()  # required parts missing: the checkpoint is refused, by name
    with pytest.raises(ValueError, match="checkpoint: .*optimizer.safetensors is missing"):
        load_checkpoint(ck, model=copy.deepcopy(model0), optimizer=make_optimizer(model0, cfg))
    (ck / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="checkpoint: .*model.safetensors is missing"):
        load_weights(ck, copy.deepcopy(model0))


def test_the_train_export_table_resolves_every_name():
    """pdmask.train's lazy table: each listed name imports, and from the module that defines it."""
    import pdmask.train as T

    for name in T.__all__:
        obj = getattr(T, name)
        home = T._EXPORTS[name]
        assert obj.__module__ == (home if home.startswith("pdmask.") else f"pdmask.train.{home}"), name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        T.nope  # noqa: B018
