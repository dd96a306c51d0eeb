"""The rates are computed from counts that a hand-built example pins down."""

import pytest
import torch

from pdmask_lab.audit.rates import classify, classify_seed, rate
from pdmask.masks import Thresholds, divergence_region

# Eight tokens. Columns: A, D, log r (ratio criterion), Ddot (predictive), dD (realized).
#   tok  A    D     log r  Ddot   dD     ratio says        predictive says
#   0   +1  0.30   +0.3   +0.2   +0.01  outward (mask)    outward (mask)    -> increase
#   1   +1  0.20   +0.3   -0.1   -0.02  outward (mask)    inward  (keep)    -> decrease
#   2   +1  0.10   -0.2   -0.3   -0.01  keep              keep              -> decrease
#   3   -1  0.40   +0.4   +0.2   -0.03  keep (A lr < 0)   keep (A Dd < 0)   -> decrease
#   4   -1  0.10   -0.5   +0.1   +0.02  outward (mask)    keep              -> increase
#   5   -1  0.50   +0.1   -0.2   +0.04  keep              outward (mask)    -> increase
#   6   +1  0.06   -0.1   -0.1    0.0   keep              keep              -> tie
#   7    0  0.90   +0.3   +0.3   +0.05  A = 0: never out of region
#   8   +1  0.04   +0.3   +0.3   +0.05  D <= delta_high = 0.05: in region
A = torch.tensor([1, 1, 1, -1, -1, -1, 1, 0, 1], dtype=torch.float64)
D = torch.tensor([0.30, 0.20, 0.10, 0.40, 0.10, 0.50, 0.06, 0.90, 0.04], dtype=torch.float64)
LOGR = torch.tensor([0.3, 0.3, -0.2, 0.4, -0.5, 0.1, -0.1, 0.3, 0.3], dtype=torch.float64)
DDOT = torch.tensor([0.2, -0.1, -0.3, 0.2, 0.1, -0.2, -0.1, 0.3, 0.3], dtype=torch.float64)
DD = torch.tensor([0.01, -0.02, -0.01, -0.03, 0.02, 0.04, 0.0, 0.05, 0.05], dtype=torch.float64)
VALID = torch.ones(9, dtype=torch.bool)


def out_of_region(dl, dh):
    """The audit's O: the masks' divergence region (what the audit's runner uses)."""
    return divergence_region("topk_kl")({"topk_kl": D}, A, Thresholds(dl, dh)) & VALID


def region():
    return out_of_region(0.05, 0.05)


def test_out_of_region_hand_example():
    # tokens 0..6 are out (D > 0.05, A != 0); 7 has A = 0; 8 has D = 0.04 <= 0.05
    assert region().tolist() == [True] * 7 + [False, False]
    # delta by the sign of A: raising delta_low to 0.45 drops tokens 3 (0.40) and 4 (0.10), keeps 5 (0.50)
    r = out_of_region(0.45, 0.05)
    assert r.tolist() == [True, True, True, False, False, True, True, False, False]


def test_counts_hand_example():
    c = classify(DD, A, {"ratio": LOGR, "pred": DDOT}, region())
    # ratio: outward {0,1,4}; kept {2,3,5,6}; unsafe {5}; corrective {2,3}; tie {6};
    #   masked-and-increase {0,4}; sign(A log r) = (+,+,-,-,+,-,-) vs realized (+,-,-,-,+,+,0):
    #   matches at 0,2,3,4 -> 4
    assert c["ratio"] == dict(n=7, kept=4, masked=3, unsafe=1, corrective=2, ties_kept=1, masked_increase=2,
                              sign_ok=4)
    # predictive: outward {0,5}; kept {1,2,3,4,6}; unsafe {4}; corrective {1,2,3}; tie {6};
    #   masked-and-increase {0,5}; sign(A Ddot) = (+,-,-,-,-,+,-): matches at 0,1,2,3,5 -> 5
    assert c["pred"] == dict(n=7, kept=5, masked=2, unsafe=1, corrective=3, ties_kept=1, masked_increase=2,
                             sign_ok=5)
    assert rate(c["ratio"], "unsafe_keep") == pytest.approx(1 / 4)
    assert rate(c["ratio"], "corrective") == pytest.approx(2 / 4)
    assert rate(c["ratio"], "sign_accuracy") == pytest.approx(4 / 7)
    assert rate(c["pred"], "unsafe_keep") == pytest.approx(1 / 5)
    assert rate(c["pred"], "corrective") == pytest.approx(3 / 5)
    assert rate(c["pred"], "sign_accuracy") == pytest.approx(5 / 7)
    assert rate(c["pred"], "mask_precision") == pytest.approx(2 / 2)


def test_tie_tolerance_moves_small_changes_to_ties():
    # |dD| <= 0.015 becomes a tie: tokens 0 (+0.01) and 2 (-0.01) and 6
    c = classify(DD, A, {"ratio": LOGR}, region(), tie_tol=0.015)["ratio"]
    # ratio kept {2,3,5,6}: unsafe {5}, corrective {3}, ties {2,6}
    assert (c["unsafe"], c["corrective"], c["ties_kept"]) == (1, 1, 2)


def test_disagreement_set_hand_example():
    res = classify_seed(DD, A, {"ratio": LOGR, "pred-exact": DDOT}, region())
    d = res["disagreement:pred-exact"]
    # outward differs at tokens 1, 4, 5. There ratio keeps {5} (increase: unsafe),
    # predictive keeps {1 (decrease), 4 (increase)}.
    assert d["ratio"]["n"] == 3 and d["pred-exact"]["n"] == 3
    assert (d["ratio"]["kept"], d["ratio"]["unsafe"], d["ratio"]["corrective"]) == (1, 1, 0)
    assert (d["pred-exact"]["kept"], d["pred-exact"]["unsafe"], d["pred-exact"]["corrective"]) == (2, 1, 1)
    # sign(A c) vs realized on {1,4,5}: ratio (+,+,-) vs (-,+,+) -> 1; predictive (-,-,+) -> 2
    assert d["ratio"]["sign_ok"] == 1 and d["pred-exact"]["sign_ok"] == 2
    assert set(res) == {"out_of_region", "disagreement:pred-exact"}


def test_classify_shape_mismatch_is_a_value_error():
    with pytest.raises(ValueError, match="dD"):
        classify(DD[:3], A, {"ratio": LOGR}, region())
