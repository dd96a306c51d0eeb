"""``pdmask audit`` resume without pickles: each finished seed is one safetensors file (the
per-token arrays as tensors, everything else as JSON in its metadata, the checkpoints'
encoding), loaded without ``torch.load``; a seed file of the old pickle format is ignored
(never unpickled) and its seed recomputed; an unreadable seed file is one line naming it."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("safetensors")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "audit"))
from audit_toy import BigramLM, bigram_forward, perturbed, sample_batch  # noqa: E402

from pdmask_lab.audit import AuditConfig, run_audit  # noqa: E402
from pdmask_lab.audit import command as C  # noqa: E402


@pytest.fixture(scope="module")
def result():
    """One real SeedResult of the toy audit (numpy records, nested dicts with int keys)."""
    pol = BigramLM(vocab=12, dim=8)
    eng = perturbed(pol, 0.3)
    cfg = AuditConfig(lr=1e-2, sample_tokens=6, disagreement_tokens=4, bootstrap=50, fidelity_ks=(1, 2, 5))
    return run_audit(pol, bigram_forward, lambda s: (*sample_batch(eng, seed=s), {"note": "toy"}), [3], cfg,
                     progress=False)[0]


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


def _refuse_unpickling(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("unpickling an audit seed")

    monkeypatch.setattr(torch, "load", refuse)
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)


def test_a_seed_round_trips_exactly_without_pickles(result, tmp_path, monkeypatch):
    C.save_seed(tmp_path, result)
    path = C.seed_path(tmp_path, result.seed)
    assert path.name == "seed-000003.safetensors" and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert not path.read_bytes().startswith(b"\x80")  # no pickle protocol header
    _refuse_unpickling(monkeypatch)
    back = C.load_seed(path)
    assert back.seed == result.seed and isinstance(back.seed, int)
    assert back.info == result.info and back.entropy == result.entropy and back.fidelity == result.fidelity
    assert set(back.tokens) == set(result.tokens)
    for k, v in result.tokens.items():
        assert isinstance(back.tokens[k], np.ndarray) and back.tokens[k].dtype == v.dtype, k
        np.testing.assert_array_equal(back.tokens[k], v)  # NaN where not measured compares equal
    assert back.counts == result.counts


def test_an_old_pickle_seed_file_is_ignored_and_its_seed_recomputed(result, tmp_path):
    marker = tmp_path / "executed"
    torch.save({"seed": 0, "info": _Evil(marker)}, tmp_path / "seed-000000.pt")  # written by an older pdmask
    C.save_seed(tmp_path, result)  # seed 3 in the new format
    msgs = []
    assert C.pending_seeds(tmp_path, [0, 3], warn=msgs.append) == [0]
    assert len(msgs) == 1 and "seed-000000.pt" in msgs[0] and "old pickle format" in msgs[0], msgs
    assert "recomputed" in msgs[0]
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["a pickle under the new name", "truncated", "not a seed file"])
def test_an_unreadable_seed_file_is_one_line_naming_it(damage, result, tmp_path, monkeypatch):
    path = C.seed_path(tmp_path, result.seed)
    marker = tmp_path / "executed"
    if damage == "a pickle under the new name":
        torch.save({"seed": 3, "info": _Evil(marker)}, path)
    elif damage == "truncated":
        C.save_seed(tmp_path, result)
        path.write_bytes(path.read_bytes()[:-50])
    else:
        from safetensors.torch import save_file

        save_file({"x": torch.zeros(2)}, str(path))  # a safetensors file, but not an audit seed
    _refuse_unpickling(monkeypatch)
    with pytest.raises(ValueError) as e:
        C.load_seed(path)
    msg = str(e.value)
    assert msg.startswith("out: ") and str(path) in msg and "\n" not in msg, msg
    assert not marker.exists()
