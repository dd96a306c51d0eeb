"""The batch-mask evaluation (pdmask_lab.audit.phi): the leave-one-out difference is two
explicit steps, the matched-fraction selection picks the top-m of O, the summary pools."""

import copy

import pytest
import torch

import pdmask

pytest.importorskip("transformers", reason="the evaluation builds a transformers model")

from pdmask_lab.audit.phi import PhiSettings, PhiStep, copy64, main, top_m  # noqa: E402
from pdmask_lab.audit.phi_report import sign_counts, summarize  # noqa: E402
from pdmask.engine.hf import HFEngine, response_logits  # noqa: E402
from tests.flat import policy_loss  # noqa: E402
from tests.flat import token_stats  # noqa: E402
from pdmask.train.config import load_config  # noqa: E402
from pdmask.train.model import build_model  # noqa: E402
from pdmask.train.update import make_optimizer, update_step  # noqa: E402

TINY = ["hidden_size=32", "num_layers=2", "num_heads=4", "intermediate_size=64", "temperature=0.8",
        "engine_precision=bf16", "lr=1e-2", "grad_clip=0.5", "weight_decay=0.1", "mode=none"]


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(None, TINY)
    model = build_model(cfg, 97, pad_id=0, eos_id=1, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    eng = HFEngine(model, eos_id=1, pad_id=0, precision="bf16", temperature=0.8, top_k_logprobs=20)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 97, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (6,), generator=g)]
    rb = eng.generate(prompts, max_new_tokens=8, seed=0)
    adv = torch.tensor([1.2, -0.7, 0.4, -1.3, 0.9, 0.0])
    opt = make_optimizer(model, cfg)
    for _ in range(2):  # a warm AdamW state, and a policy that has drifted from the engine
        update_step(model, opt, rb, adv, cfg)
    return cfg, model, rb, adv, copy.deepcopy(opt.state_dict())


def _explicit_phi(model, rb, adv_bt, cfg, state, O, divergence="topk_kl"):
    """Phi (O fixed) after one trainer step on a fresh float64 copy with advantages adv_bt (B, T)."""
    m = copy64(model)
    opt = torch.optim.AdamW(m.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay)
    opt.load_state_dict(copy.deepcopy(state))
    logits = response_logits(m, rb.sequences, rb.attention_mask, rb.prompt_len)
    r = rb.rollout.replace(sampled_logprob=rb.rollout.sampled_logprob.double(),
                           topk_logprobs=rb.rollout.topk_logprobs.double(), logits=None)
    pdmask.policy_loss(logits, r, adv_bt, mode="none", corrections=cfg.loss.corrections,
                       aggregation=cfg.loss.aggregation, sampling=cfg.loss.sampling).loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), cfg.grad_clip)
    opt.step()
    with torch.no_grad():
        z = response_logits(m, rb.sequences, rb.attention_mask, rb.prompt_len)
    D = pdmask.token_stats(z, r, sampling=cfg.loss.sampling)[divergence]
    return float((D * O).sum())


def test_leave_one_out_equals_two_explicit_steps(setup):
    cfg, model, rb, adv, state = setup
    ps = PhiStep(model, rb, adv, cfg, state, thresholds=pdmask.Thresholds(1e-3, 1e-3))
    O = ps.O
    assert 3 <= int(O.sum()) < int(rb.response_mask.sum())
    A = ps.A.clone()
    full = _explicit_phi(model, rb, A, cfg, state, O)
    assert ps.phi_after(None) == pytest.approx(full, rel=1e-12)
    assert abs(full - ps.phi0) > 1e-4  # the step moves Phi
    toks = O.nonzero()[:3]
    loo = ps.loo(toks)
    for (b, t), got in zip(toks.tolist(), loo.tolist()):
        A_t = A.clone()
        A_t[b, t] = 0.0  # a zero advantage zeroes the token's term and nothing else
        want = full - _explicit_phi(model, rb, A_t, cfg, state, O)
        assert got == pytest.approx(want, rel=1e-8, abs=1e-14), (b, t)
        assert abs(want) > 1e-9
    # a set of tokens left out at once
    E = top_m(ps.A.abs(), O, 3)
    got = ps.phi_after(ps.excluded_grad(E))
    assert got == pytest.approx(_explicit_phi(model, rb, torch.where(E, 0.0, A), cfg, state, O), rel=1e-12)
    assert ps.excluded_grad(torch.zeros_like(E)) is None
    # the caller's model is untouched
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_top_m_picks_the_highest_scores_of_the_region():
    score = torch.tensor([[0.5, 9.0, -1.0, 2.0],
                          [3.0, 2.0, 7.0, 0.1]])
    region = torch.tensor([[True, False, True, True],
                           [True, True, False, True]])  # 9.0 and 7.0 lie outside: never picked
    # region scores in row-major order: 0.5, -1, 2 | 3, 2, 0.1 -> ranking 3, 2 (row 0), 2 (row 1), 0.5, 0.1, -1
    assert top_m(score, region, 1).nonzero().tolist() == [[1, 0]]
    assert top_m(score, region, 2).nonzero().tolist() == [[0, 3], [1, 0]]
    # the tie 2.0 / 2.0: the earlier position (row 0) first
    assert top_m(score, region, 3).nonzero().tolist() == [[0, 3], [1, 0], [1, 1]]
    assert top_m(score, region, 5).nonzero().tolist() == [[0, 0], [0, 3], [1, 0], [1, 1], [1, 3]]
    assert torch.equal(top_m(score, region, 99), region) and not top_m(score, region, 0).any()
    with pytest.raises(ValueError, match="^score: expected shape"):
        top_m(score[:1], region, 1)


def test_sign_counts_and_pooled_summary():
    def rec(seed, loo, in_O, batch, ratio, nO, dphi):
        return {"seed": seed, "n_tokens": 100, "n_out_of_region": nO, "phi0": 1.0, "phi_full": 1.0 + dphi["none"],
                "sweep": {"0.5": {"m": 2, **{c: dphi[c] for c in ("random", "ratio", "pdm-exact", "pdm-batch")}}},
                "own_mask": {c: {"m": 1, "dphi": dphi[c]} for c in ("ratio", "pdm-exact", "pdm-batch")},
                "loo": {"b": [0] * len(loo), "t": list(range(len(loo))), "in_O": in_O, "loo": loo,
                        "pred": [1.0] * len(loo), "scores": {"pdm-batch": batch, "ratio": ratio, "pdm-exact": ratio}}}

    d = {"none": 0.4, "random": 0.3, "ratio": 0.2, "pdm-exact": 0.2, "pdm-batch": 0.1}
    a = rec(0, [1.0, -2.0, 0.0, 3.0], [True, True, True, False], [2.0, -1.0, 5.0, 1.0], [-1.0, -1.0, 1.0, 1.0], 4, d)
    b = rec(1, [-1.0, 1.0], [True, True], [-0.5, 0.5], [1.0, 1.0], 6, d)
    # seed 0 on O: tokens 0, 1 right for batch (token 2 is a tie); ratio: token 1 right only
    assert sign_counts(a, "pdm-batch", True) == (2, 2, 1) and sign_counts(a, "ratio", True) == (1, 2, 1)
    assert sign_counts(a, "pdm-batch", False) == (1, 1, 0)
    s = summarize([a, b], PhiSettings(batch_lasts=(), fractions=(0.5,), bootstrap=200))
    acc = s["sign_accuracy"]["O"]
    assert (acc["pdm-batch"]["correct"], acc["pdm-batch"]["n"], acc["pdm-batch"]["ties"]) == (4, 4, 1)
    assert (acc["ratio"]["correct"], acc["ratio"]["n"]) == (2, 4) and acc["ratio"]["estimate"] == 0.5
    assert acc["pdm-batch vs ratio"] == {"only_batch_right": 2, "only_other_right": 0, "p_mcnemar": 0.5}
    mf = s["matched_fraction"]["0.5"]
    assert mf["pdm-batch"]["estimate"] == pytest.approx(0.2 / 10)  # (0.1 + 0.1) / (4 + 6)
    assert mf["none"]["estimate"] == pytest.approx(0.8 / 10)
    assert mf["pdm-batch - ratio"]["estimate"] == pytest.approx((-0.1 / 4 - 0.1 / 6) / 2)
    assert mf["pdm-exact - ratio"]["estimate"] == pytest.approx(0.0)  # the per-token direction vs the ratio
    assert s["n_out_of_region"] == 10 and s["n_seeds"] == 2


def length_parity(text: str, answer: str) -> float:
    """A reward that varies on an untrained model (so GRPO advantages are not all 0)."""
    return float(len(text) % 2)


def test_cli_runs_end_to_end_and_resumes(tmp_path, capsys):
    """``python -m pdmask_lab.audit.phi`` on a tiny built-in model with lag steps (warm AdamW):
    phi.json / phi.md written; a rerun reuses the finished seeds; bad settings: one line."""
    over = ["vocab_size=300", "hidden_size=32", "intermediate_size=64", "num_layers=1", "num_heads=2",
            "train_size=300", "eval_size=8", "sft_steps=0", "prompts_per_step=2", "group_size=4",
            "max_new_tokens=6", "top_k=5", "engine_precision=fp8-bf16", "lr=1e-2", f"cache_dir={tmp_path / 'c'}",
            f"reward={__name__}:length_parity"]
    args = ["--out", str(tmp_path / "phi"), "--seeds", "2", "--lag", "1", "--delta", "1e-4", "--fractions", "0.5",
            "--loo-tokens", "3", "--loo-outside", "2", "--bootstrap", "50"]
    for kv in over:
        args += ["--set", kv]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 0
    import json
    doc = json.loads((tmp_path / "phi" / "phi.json").read_text())
    assert [r["seed"] for r in doc["records"]] == [0, 1]
    assert doc["summary"]["n_out_of_region"] > 0 and "pdm-batch" in doc["summary"]["sign_accuracy"]["O"]
    md = (tmp_path / "phi" / "phi.md").read_text()
    assert "## Sign accuracy" in md and "CPU capability" in md  # the environment line
    assert all(r["time_s"] > 0 for r in doc["records"]) and "Wall time:" in md and "over the 2 seeds" in md
    stamp = (tmp_path / "phi" / "seeds" / "seed-00000.json").stat().st_mtime_ns
    # without leave-one-out the page says so instead of an empty section
    no_loo = [a if a != str(tmp_path / "phi") else str(tmp_path / "phi0") for a in args]
    with pytest.raises(SystemExit) as e:
        main(no_loo + ["--seeds", "1", "--loo-tokens", "0", "--loo-outside", "0"])
    md0 = (tmp_path / "phi0" / "phi.md").read_text()
    assert e.value.code == 0 and "Leave-one-out not measured" in md0 and "## Sign accuracy" not in md0
    assert "## Realized change of Phi at matched masked fraction" in md0
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 0  # the same settings resume (a refusal would also leave the file alone)
    assert (tmp_path / "phi" / "seeds" / "seed-00000.json").stat().st_mtime_ns == stamp  # reused, not redone
    with pytest.raises(SystemExit) as e:
        main(args + ["--fractions", "0.5,2"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: fractions: each must lie in (0, 1], got [0.5, 2.0]"


def test_a_run_stored_with_flat_deltas_resumes(tmp_path):
    """A settings.json of the version whose settings held O's deltas flat is read in the
    current terms: the same deltas resume, other deltas are refused."""
    import json

    from pdmask_lab.audit.phi import PhiRun

    th = {"delta_low": 0.005, "delta_high": 0.005, "eps_low": 0.2, "eps_high": 0.28, "dual_clip": None}
    (tmp_path / "settings.json").write_text(json.dumps({"divergence": "topk_kl", "delta_low": 0.005,
                                                        "delta_high": 0.005, "fractions": [0.25]}))
    PhiRun(tmp_path, {"divergence": "topk_kl", "thresholds": th, "fractions": (0.25,)}).open()
    assert json.loads((tmp_path / "settings.json").read_text())["thresholds"] == th  # now in the current terms
    (tmp_path / "settings.json").write_text(json.dumps({"divergence": "topk_kl", "delta_low": 0.01,
                                                        "delta_high": 0.005, "fractions": [0.25]}))
    with pytest.raises(ValueError, match=r"holds results of other settings \(thresholds\)"):
        PhiRun(tmp_path, {"divergence": "topk_kl", "thresholds": th, "fractions": (0.25,)}).open()


@pytest.mark.usefixtures("one_thread")  # bitwise: the norm is this formula, the same ops, on one thread
def test_copy64_computes_in_float64_and_leaves_the_model_alone(setup):
    cfg, model, rb, _, _ = setup
    m = copy64(model)
    norm = m.model.norm
    x = torch.randn(2, 3, 32, dtype=torch.float64)
    # the float64 formula, not transformers' float32 round trip
    want = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
    assert torch.equal(norm(x), want) and norm(x).dtype == torch.float64
    assert not torch.equal(norm(x), type(norm).forward(norm, x))  # the stock forward rounds to float32
    z64 = response_logits(m, rb.sequences, rb.attention_mask, rb.prompt_len)
    with torch.no_grad():
        z32 = response_logits(model, rb.sequences, rb.attention_mask, rb.prompt_len)
    assert z64.dtype == torch.float64 and next(model.parameters()).dtype == torch.float32
    torch.testing.assert_close(z64.float(), z32, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["real-lm/phi-fp8-lag2", "batch/phi-stress"])
def test_the_committed_phi_pages_rebuild_from_their_json(name):
    """Every committed phi.md is what the current code writes from its phi.json, whichever
    version of the settings (flat deltas before the typed thresholds) that file holds."""
    import json
    from pathlib import Path

    from pdmask_lab.audit.phi_report import markdown

    d = Path(__file__).resolve().parents[2] / "docs" / "results" / name
    assert markdown(json.loads((d / "phi.json").read_text())) == (d / "phi.md").read_text()
