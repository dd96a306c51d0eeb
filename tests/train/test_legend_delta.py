"""The report figures' legends give a mode's δ only where its loss reads one (issue 41): the
regime comparison's legend printed ``none δ=0.02`` and ``grpo δ=0.02``, but ``none`` masks
nothing and ``grpo`` clips the ratio by epsilon. The group labels keying the summaries keep
their δ."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from pdmask_lab.report import has_delta, legend_label, plot_curve_bands, plot_eval_bands, plot_runs  # noqa: E402


@pytest.mark.parametrize("group,shown", [
    ("none δ=0.02", "none"), ("grpo δ=0.02", "grpo"), ("grpo@old δ=0.05", "grpo@old"),
    ("dppo-topk-kl δ=0.02", "dppo-topk-kl δ=0.02"), ("drpo δ=0.057", "drpo δ=0.057"),
    ("spo δ=0.2", "spo δ=0.2"), ("pdm-smooth-topk-kl δ=0.02", "pdm-smooth-topk-kl δ=0.02"),
    ("dppo-topk-kl@old δ=0.041", "dppo-topk-kl@old δ=0.041"), ("none", "none"), ("my-mode δ=1", "my-mode δ=1"),
])
def test_legend_label(group, shown):
    assert legend_label(group) == shown


def test_has_delta_reads_the_registry():
    assert not has_delta("none") and not has_delta("grpo")
    assert all(has_delta(m) for m in ("dppo-topk-kl", "pdm-topk-tv", "drpo", "spo", "dppo-binary-kl"))


def _run(root, mode, seed):
    d = root / f"{mode}-s{seed}"
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(f"loss:\n  mode: {mode}\n  thresholds:\n    delta_low: 0.02\n    delta_high: 0.02\n")
    recs = [{"step": s, "eval_accuracy": 0.1 * s + 0.01 * seed, "reward": 0.2, "entropy_mean": 1.0,
             "mismatch_topk_kl": 1e-3, "masked_frac": 0.0, "finish_rate": 1.0} for s in range(3)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def test_the_figures_legends(tmp_path, monkeypatch):
    import matplotlib.axes

    labels = []
    real_plot = matplotlib.axes.Axes.plot

    def plot(self, *a, **kw):
        if kw.get("label"):
            labels.append(kw["label"])
        return real_plot(self, *a, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    runs = [_run(tmp_path / "runs", m, s) for m in ("none", "grpo", "pdm-topk-kl") for s in (0, 1)]
    plot_eval_bands(runs, tmp_path / "a")
    plot_curve_bands(runs, tmp_path / "b")
    plot_runs(runs, tmp_path / "c")
    assert labels and not [x for x in labels if x.startswith(("none δ", "grpo δ"))], labels
    assert any(x.startswith("pdm-topk-kl δ=0.02") for x in labels)
    assert any(x.startswith("none (") for x in labels) and any(x.startswith("grpo (") for x in labels)
