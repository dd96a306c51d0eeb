"""The core's extension point as the batch-aware mask uses it: the ``pdm-batch-*`` modes that
:mod:`pdmask_lab.batchmask` registers read its direction as the per-token extra ``ddot_batch``
(``extras=``; the tests' flat ``batch_ddot=`` keyword)."""

import pytest
import torch

import pdmask
from pdmask_lab.batchmask import DDOT as BATCH_DDOT
from tests import flat  # noqa: E402


def _batch(B=3, T=7, V=50, K=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    logmu = torch.log_softmax(z + torch.randn(B, T, V, generator=g, dtype=torch.float64), -1)
    k = torch.multinomial(logmu.exp().reshape(-1, V), 1, generator=g).reshape(B, T)
    tk_lp, tk_ids = logmu.topk(K, -1)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, -3:] = False
    adv = torch.tensor([1.5, -0.7, 0.0], dtype=torch.float64)[:B]
    bd = torch.randn(B, T, generator=g, dtype=torch.float64)
    return (z, k, logmu.gather(-1, k[..., None])[..., 0], tk_ids, tk_lp, adv, mask), bd


@pytest.mark.parametrize("div", ["kl", "tv"])
def test_region_gated_batch_mode_masks_out_of_region_tokens_with_outward_batch_direction(div):
    args, bd = _batch()
    delta = 0.03
    out = flat.policy_loss(*args, mode=f"pdm-batch-topk-{div}", batch_ddot=bd, delta_low=delta, delta_high=delta)
    st = flat.token_stats(*args[:5], response_mask=args[6])
    A = args[5][:, None].expand_as(bd)
    out_region = (st[f"topk_{div}"] > delta) & (A != 0)
    want = ~(out_region & (A * bd > 0)) | ~args[6]
    assert torch.equal(out.mask, want)
    assert 0 < (~want).sum() < (args[6] & (A != 0)).sum()  # not vacuous: some masked, some kept
    assert torch.equal(out.stats[BATCH_DDOT][args[6]], bd[args[6]])
    # the same decision through trust_region_mask
    m = flat.trust_region_mask(*args, mode=f"pdm-batch-topk-{div}", batch_ddot=bd, delta_low=delta,
                                 delta_high=delta)
    assert torch.equal(m, want)


def test_scope_all_mode_masks_every_outward_token_whatever_its_divergence():
    args, bd = _batch()
    out = flat.policy_loss(*args, mode="pdm-batch-all-topk-kl", batch_ddot=bd, delta_low=1e9, delta_high=1e9)
    A = args[5][:, None].expand_as(bd)
    assert torch.equal(out.mask, ~(A * bd > 0) | ~args[6])
    # masked tokens carry no loss and no gradient; kept ones do
    assert (out.token_loss[~out.mask] == 0).all() and (out.token_loss[out.mask & (A != 0) & args[6]] != 0).all()


@pytest.mark.usefixtures("one_thread")  # bitwise: the other mode's loss runs the same ops, on one thread
def test_batch_ddot_is_kept_in_the_stats_of_any_mode_and_never_changes_another_mode():
    args, bd = _batch()
    a = flat.policy_loss(*args, mode="pdm-topk-kl", batch_ddot=bd)
    b = flat.policy_loss(*args, mode="pdm-topk-kl")
    assert torch.equal(a.mask, b.mask) and torch.equal(a.loss, b.loss)
    assert torch.equal(a.stats[BATCH_DDOT][args[6]], bd[args[6]]) and BATCH_DDOT not in b.stats


@pytest.mark.parametrize("mode", ["pdm-batch-topk-kl", "pdm-batch-topk-tv", "pdm-batch-all-topk-kl",
                                  "pdm-batch-all-topk-tv"])
def test_batch_modes_refuse_without_batch_ddot(mode):
    args, _ = _batch()
    for fn in (pdmask.policy_loss, pdmask.trust_region_mask):
        with pytest.raises(ValueError, match=r"^extras: mode .* reads the per-token tensor 'ddot_batch'") as e:
            fn(*args[:1], flat.rollout(**dict(zip(flat.POSITIONAL, args[1:]))), args[5], mode=mode)
        assert "\n" not in str(e.value)


def test_bad_batch_ddot_gets_one_line_errors_and_padding_junk_is_ignored():
    args, bd = _batch()
    mode = "pdm-batch-topk-kl"
    for bad, msg in [(bd[:, :-1], "of shape"), (bd.long(), "floating-point"), ([0.0], "floating-point")]:
        with pytest.raises(ValueError, match=rf"^extras\['ddot_batch'\]: .*{msg}"):
            flat.policy_loss(*args, mode=mode, batch_ddot=bad)
    nan = bd.clone()
    nan[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"^extras\['ddot_batch'\]: contains NaN or inf on response tokens"):
        flat.policy_loss(*args, mode=mode, batch_ddot=nan)
    pad = bd.clone()
    pad[0, -1] = float("nan")  # a padding position
    out = flat.policy_loss(*args, mode=mode, batch_ddot=pad)
    assert torch.isfinite(out.loss)


def test_the_batch_modes_are_registered_by_the_batch_mask_not_by_import_pdmask():
    """``import pdmask`` loads no batch mask and knows no ``pdm-batch-*`` mode; importing
    ``pdmask_lab.batchmask`` registers them on the core's extension point (``MaskMode.extras``)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, pdmask\n"
            "assert not [m for m in sys.modules if m.startswith('pdmask_lab.batchmask')]\n"
            "assert not [m for m in pdmask.MODES if m.startswith('pdm-batch-')]\n"
            "import pdmask_lab.batchmask\n"
            "modes = [m for m in pdmask.MODES if m.startswith('pdm-batch-')]\n"
            "assert len(modes) == 4 and all(pdmask.MODES[m].extras == ('ddot_batch',) for m in modes), modes\n"
            "print('ok')\n")
    src = str(Path(__file__).resolve().parents[2] / "src")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
