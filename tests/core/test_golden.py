"""Float64 golden per-token values (tests/data/golden_ddot.json, copied from the
project's shared test data): divergences and every Ddot variant, sampled token inside
and outside the top-K, K from 1 to V."""

import json
from pathlib import Path

import pytest
import torch

import pdmask
from tests import flat  # noqa: E402

CASES = json.loads((Path(__file__).parents[1] / "data" / "golden_ddot.json").read_text())["cases"]
KEYS = {"logprob": "logp"}


def _stats(c):
    f64 = torch.float64
    return flat.token_stats(
        torch.tensor(c["logits"], dtype=f64)[None, None],
        torch.tensor([[c["sampled_id"]]]),
        torch.tensor([[c["rollout_logprob"]]], dtype=f64),
        torch.tensor(c["rollout_topk_ids"])[None, None],
        torch.tensor(c["rollout_topk_logprobs"], dtype=f64)[None, None],
        rollout_logits=torch.tensor(c["rollout_logprobs_full"], dtype=f64)[None, None],
        temperature=c["temperature"],
    )


@pytest.mark.parametrize("i", range(len(CASES)), ids=lambda i: f"V{CASES[i]['V']}-K{CASES[i]['K']}-case{i}")
def test_golden_case(i):
    c = CASES[i]
    st = _stats(c)
    for key, want in c["expected"].items():
        got = st[KEYS.get(key, key)].item()
        assert got == pytest.approx(want, rel=1e-8, abs=1e-12), key


def test_golden_covers_inside_and_outside_topk():
    assert {c["sampled_in_topk"] for c in CASES} == {True, False}
    for c in CASES:
        assert bool(_stats(c)["sampled_in_topk"].item()) == c["sampled_in_topk"]
