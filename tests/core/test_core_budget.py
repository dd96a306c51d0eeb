"""The core's budget, measured: the README quickstart's loss call runs functions of at most 7
pdmask modules (``sys.setprofile``; issue 32), and an addition to the core is one registration
plus its oracle test and its doc row (issue 42; this replaced a budget of 3,300 lines): the
three blocks of docs/core.md's "Adding a surrogate, a divergence or a mode" run here, and once
they have, exactly their oracles and doc rows are missing, while everything else that lists,
checks or records modes, surrogates and divergences already knows them."""

import contextlib
import re
import sys
from pathlib import Path

import pytest
import torch

import pdmask
from pdmask import keys, masks, surrogates

from .registry_checks import missing_doc_rows, missing_oracles

#: The module budget (issue 32's "done means"; 14 modules before it).
MAX_MODULES = 7
CORE_MD = Path(__file__).resolve().parents[2] / "docs" / "core.md"


def _quickstart():
    """The README quickstart's inputs (tests/test_readme.py runs the README itself)."""
    B, T, V, K = 2, 8, 1000, 20
    torch.manual_seed(0)
    logits = (3 * torch.randn(B, T, V)).requires_grad_()
    mu = torch.log_softmax(logits.detach() + 0.5 * torch.randn(B, T, V), -1)
    sampled_ids = torch.distributions.Categorical(logits=mu).sample()
    topk = mu.topk(K, dim=-1)
    rollout = pdmask.Rollout(sampled_ids=sampled_ids, sampled_logprob=mu.gather(-1, sampled_ids[..., None]).squeeze(-1),
                             topk_ids=topk.indices, topk_logprobs=topk.values,
                             response_mask=torch.ones(B, T, dtype=torch.bool))
    spec = dict(mode="pdm-topk-kl", estimator="exact", thresholds=pdmask.Thresholds(delta_low=0.05, delta_high=0.05),
                corrections=pdmask.Corrections(is_cap=5.0), aggregation=pdmask.Aggregation("seq-mean-token-sum-norm"))
    return logits, rollout, torch.tensor([1.0, -1.0]), spec


def modules_run(fn) -> set[str]:
    """The pdmask modules whose functions run during ``fn()``."""
    seen: set[str] = set()

    def profile(frame, event, arg):
        name = frame.f_globals.get("__name__", "")
        if event == "call" and (name == "pdmask" or name.startswith("pdmask.")):
            seen.add(name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def test_the_quickstart_loss_call_runs_at_most_seven_modules():
    logits, rollout, adv, spec = _quickstart()
    out = {}

    def call():
        out["loss"] = pdmask.policy_loss(logits, rollout, adv, **spec)

    seen = modules_run(call)
    assert {"pdmask.loss", "pdmask.stats", "pdmask.ops", "pdmask.masks"} <= seen  # the profile sees the core
    assert len(seen) <= MAX_MODULES, sorted(seen)
    # the backward too (the op's gradient), in the same modules
    assert modules_run(lambda: out["loss"].loss.backward()) <= seen and logits.grad is not None


def test_the_profile_counts_every_module_it_enters():
    """The measure can fail: a call that enters a module outside the loss's is counted."""
    from pdmask import keys

    assert "pdmask.keys" in modules_run(lambda: keys.ddot_key("topk_kl"))


# ------------------------------------------------------------------ the interface budget
@contextlib.contextmanager
def registries_restored():
    """The registries (and the tables the divergence registry fills) as they were, afterwards."""
    saved = [(t, t.copy()) for t in (keys.TOPK_DIVERGENCES, keys.DDOT_KEY, keys.TOPK_DDOTS, surrogates.SURROGATES,
                                     masks.MODES)]
    lists = [(t, list(t)) for t in (keys.DIVERGENCES, surrogates.SMOOTH_SURROGATES)]
    try:
        yield
    finally:
        for t, v in saved:
            t.clear()
            t.update(v)
        for t, v in lists:
            t[:] = v


def adding_blocks() -> list[str]:
    """The python blocks of docs/core.md's section on additions, in order."""
    text = CORE_MD.read_text()
    sec = text[text.index("## Adding a surrogate, a divergence or a mode"):]
    sec = sec[:sec.index("\n## ", 5)]
    return re.findall(r"^```python\n(.*?)^```", sec, flags=re.S | re.M)


ADDED = {"divergence": {"topk_hellinger"}, "surrogate": {"sapo"}, "mode": {"sapo", "pdm-smooth-topk-js"}}


def test_an_addition_is_its_registration_its_oracle_and_its_doc_row():
    blocks = adding_blocks()
    assert len(blocks) == 3
    assert missing_oracles() == {} and missing_doc_rows() == {}
    with registries_restored():
        for i, block in enumerate(blocks):
            exec(compile(block, f"{CORE_MD}: block {i + 1} of the additions", "exec"), {"__name__": "__doc__"})
        # what the registration leaves to do: exactly the oracle test and the doc row
        assert missing_oracles() == ADDED
        assert missing_doc_rows() == ADDED
        _everything_else_knows_them()
    assert "topk_hellinger" not in pdmask.keys.TOPK_DIVERGENCES and "sapo" not in pdmask.MODES


def _everything_else_knows_them():
    """No other file changes: the statistics, the derivative, the defaults, the loss, the plugins'
    mode lists, the trainer's help and its record read the registries."""
    from pdmask.integrations.verl.losses import registered_names
    from pdmask.train.config import field_help, load_config

    from .helpers import ddot_autograd, make_case, stats_of

    c = make_case(6, 20, 4, seed=9)
    st = stats_of(c)
    assert {"topk_hellinger", "ddot_topk_hellinger_exact", "ddot_topk_hellinger_uniform"} <= set(st)
    torch.testing.assert_close(st["ddot_topk_hellinger_exact"],
                               ddot_autograd(_hellinger_fn(c), c["logits"], c["sampled_ids"]), rtol=1e-7, atol=1e-11)
    assert pdmask.MODES["pdm-smooth-topk-js"].default_delta == pdmask.divergences.default_delta("topk_js")
    for mode in ("sapo", "pdm-smooth-topk-js"):
        out = pdmask.policy_loss(c["logits"][None].clone().requires_grad_(True),
                                 pdmask.Rollout(c["sampled_ids"][None], c["rollout_logprob"][None], c["topk_ids"][None],
                                                c["topk_logprobs"][None]), torch.tensor([1.0]), mode=mode)
        out.loss.backward()
        assert torch.isfinite(out.loss)
    with contextlib.suppress(ImportError):  # the TRL plugin imports TRL (its CI environment)
        from pdmask.integrations.trl.options import accepted_modes

        assert {"sapo", "pdm-smooth-topk-js"} <= set(accepted_modes())
    assert ("pdm-smooth-topk-js", "exact") in registered_names().values()  # verl (sapo has no region: verl's own)
    assert any("pdm-smooth-topk-js (0.0125)" in row[3] for row in field_help() if row[0] == "loss.mode")
    cfg = load_config(None, ["mode=sapo"]).to_dict()
    assert cfg["mode_spec"] == {"surrogate": "sapo", "divergence": "topk_kl"}


def _hellinger_fn(c):
    """Squared Hellinger on topK ∪ {k} and one tail bucket, of the full pi (the autograd oracle)."""
    from .helpers import support_mask

    S = support_mask(c["topk_ids"], c["sampled_ids"], c["logits"].shape[-1])
    mu = c["logmu"].exp()

    def fn(_mu, pi):
        body = torch.where(S, (mu.sqrt() - pi.sqrt()) ** 2, torch.zeros_like(pi)).sum(-1)
        tail = (torch.where(S, 0.0, mu).sum(-1).sqrt() - torch.where(S, 0.0, pi).sum(-1).sqrt()) ** 2
        return 0.5 * (body + tail)

    return fn


@pytest.mark.parametrize("kind", ["divergence", "surrogate", "mode"])
def test_the_interface_check_can_fail(kind, monkeypatch):
    """A registration without its doc row is seen (the row removed from a copy of the page)."""
    from . import registry_checks

    name = {"divergence": "topk_js", "surrogate": "ppo-clip", "mode": "cispo"}[kind]
    text = "\n".join(line for line in CORE_MD.read_text().splitlines() if not line.startswith(f"| `{name}`"))
    monkeypatch.setattr(registry_checks, "doc_rows", lambda k, t=None, _f=registry_checks.doc_rows: _f(k, text))
    assert registry_checks.missing_doc_rows() == {kind: {name}}
