"""The core's size, measured (issue 32): the README quickstart's loss call runs functions of
at most 7 pdmask modules (``sys.setprofile``), and the core plus ops is at most 3,000 lines."""

import sys

import torch

import pdmask
from tests.test_layers import CORE_MODULES, SRC

#: The budgets (issue 32's "done means"; 14 modules and about 3,950 lines before it). The line
#: budget grew by the anchor (issue 44: `anchor.py` and the three-policy loss, about 280 lines);
#: issue 42 replaces it with a budget on the interface (the files an addition must change).
MAX_MODULES = 7
MAX_LINES = 3300


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


def test_core_and_ops_fit_the_line_budget():
    files = [SRC / "pdmask" / f"{m}.py" for m in sorted(CORE_MODULES)] + sorted((SRC / "pdmask" / "ops").rglob("*.py"))
    assert all(p.is_file() for p in files) and len(files) > len(CORE_MODULES) + 1
    lines = {p.name: len(p.read_text().splitlines()) for p in files}
    assert sum(lines.values()) <= MAX_LINES, (sum(lines.values()), lines)
