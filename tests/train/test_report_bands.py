"""pdmask report: seed bands of the eval curves, and the across-seed summary rebuilt from run directories."""

import json

import pytest
from compare_toy import REF, make_compare_dir, runs_of

from pdmask_lab.report import eval_bands, plot_curve_bands, plot_eval_bands, summary_markdown
from pdmask_lab.seed_summary import seed_markdown, seed_summary, seed_tables


@pytest.fixture
def compare_dir(tmp_path):
    return make_compare_dir(tmp_path / "cmp")


def test_eval_bands_numbers(compare_dir):
    b = eval_bands(runs_of(compare_dir))
    assert set(b) == {"dppo-topk-kl", "pdm-topk-kl", "none"}
    r = b["dppo-topk-kl"]
    assert r["steps"] == list(range(9)) and r["seeds"] == 4 and r["n"] == [4] * 9
    # step 0 is the shared SFT base; after it the seeds are REF + 0.01 * seed: mean +0.015, min +0, max +0.03
    assert r["mean"][0] == r["lo"][0] == r["hi"][0] == REF[0]
    assert r["mean"][8] == pytest.approx(REF[8] + 0.015)
    assert (r["lo"][8], r["hi"][8]) == pytest.approx((REF[8], REF[8] + 0.03))
    # pdm: REF + 0.01 s + (0.10, 0.05, -0.02, 0.07)[s] -> at a step: +0.10, +0.06, 0.00, +0.10
    p = b["pdm-topk-kl"]
    assert (p["lo"][1], p["hi"][1]) == pytest.approx((REF[1], REF[1] + 0.10))
    assert p["mean"][1] == pytest.approx(REF[1] + 0.065)


def test_band_plot_is_written(compare_dir, tmp_path):
    p = plot_eval_bands(runs_of(compare_dir), tmp_path / "rep")
    assert p.name == "eval_accuracy_bands.png" and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bands_of_any_metric_smooth_each_seed_first(compare_dir):
    # none logs mismatch 1e-2 * t on every seed; a trailing mean of 3 at step 3 is (1 + 2 + 3)e-2 / 3
    b = eval_bands(runs_of(compare_dir), "mismatch_topk_kl", window=3)["none"]
    assert b["steps"] == list(range(1, 9)) and b["n"] == [4] * 8
    assert b["mean"][0] == pytest.approx(1e-2) and b["mean"][2] == pytest.approx(2e-2)
    assert b["lo"][7] == b["hi"][7] == pytest.approx(7e-2)  # (6 + 7 + 8)e-2 / 3
    assert eval_bands(runs_of(compare_dir), "entropy_mean")["none"]["steps"] == []  # not logged: empty
    p = plot_curve_bands(runs_of(compare_dir), compare_dir / "rep")
    assert p.name == "curves_bands.png" and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tables_and_markdown_render(compare_dir):
    from rich.console import Console

    s = seed_summary(runs_of(compare_dir), n_boot=500)
    c = Console(width=300, record=True)
    for t in seed_tables(s):
        c.print(t)
    text = c.export_text()
    # pdm vs reference, final accuracy: +0.050 ... p = 0.25
    assert "pdm-topk-kl" in text and "p = 0.25" in text and "p = 0.125" in text
    md = seed_markdown(s)
    assert md.startswith("## Across seeds (4 seeds per mode at most)")
    assert "| none | dppo-topk-kl | 4 | -0.450 [-0.450, -0.450] p = 0.125 |" in md
    assert "2/2^4 = 0.125" in md and "`eval_auc`:" in md
    # the pooled masked fraction of the reference, with tokens: 3.000% [...] (80,000 tokens)
    assert "3.000% [" in md and "(80,000 tokens)" in md
    assert summary_markdown({"across_seeds": s}).count("## Across seeds") == 1


def test_report_rebuilds_the_summary_in_a_compare_dir(compare_dir, tmp_path, cli):
    run_cli, _ = cli
    # an existing compare summary: its other keys must survive the rebuild
    (compare_dir / "summary.json").write_text(json.dumps({"total_wall_s": 12.0, "load_avg_start": [0.5, 0.5, 0.5],
                                                          "step_time_ratio_runs": {}}))
    p = run_cli(["report", compare_dir], cwd=tmp_path)
    assert "Paired difference vs dppo-topk-kl" in p.stdout
    res = json.loads((compare_dir / "summary.json").read_text())
    assert res["total_wall_s"] == 12.0 and len(res["runs"]) == 12
    v = next(e for e in res["across_seeds"]["groups"] if e["group"] == "pdm-topk-kl")["vs_reference"]
    assert v["eval_final"]["estimate"] == pytest.approx(0.05) and v["eval_final"]["p"] == 0.25
    md = (compare_dir / "summary.md").read_text()
    assert "total wall time 12 s" in md and "## Across seeds" in md
    assert (compare_dir / "report" / "eval_accuracy_bands.png").exists()
    assert (compare_dir / "report" / "overview.png").exists()

    # an explicit reference that is not among the runs: one line, exit 2
    p = run_cli(["report", compare_dir, "--reference", "grpo"], cwd=tmp_path, check=False)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: reference: mode 'grpo' is not among the runs' modes (dppo-topk-kl, none, pdm-topk-kl)"]

    # a single run directory: the summary goes next to the PNGs
    out = tmp_path / "rep"
    run_cli(["report", compare_dir / "none-s0", "--out", out], cwd=tmp_path)
    one = json.loads((out / "summary.json").read_text())["across_seeds"]
    assert [e["group"] for e in one["groups"]] == ["none"] and one["groups"][0]["n_seeds"] == 1
    assert one["notes"] == ["No paired differences: the reference mode dppo-topk-kl is not among the runs."]


@pytest.mark.parametrize("text, says", [("{not json", "not a readable JSON summary"), ("[1, 2]", "holds a list")])
def test_a_damaged_summary_is_named_in_one_line(compare_dir, text, says):
    """A run's damaged summary.json is refused naming the file, not a JSONDecodeError traceback."""
    from pdmask_lab.report import load_summaries

    runs = runs_of(compare_dir)
    bad = runs[1] / "summary.json"
    bad.write_text(text)
    with pytest.raises(ValueError, match=f"{bad}: {says}") as e:
        load_summaries(runs)
    assert "\n" not in str(e.value)


def test_every_mode_in_a_figure_gets_its_own_colour():
    """The regime comparison's six modes once drew `none` and `pdm-smooth-topk-kl` in the same
    brown (the fallback cycled matplotlib's C0-C9): every registered mode, plus modes a user
    registers, must get pairwise different colours."""
    from matplotlib.colors import to_rgb

    from pdmask_lab.report import _COLORS, mode_colors
    from pdmask.masks import MODES

    names = list(MODES) + [f"user-mode-{i}" for i in range(16 - sum(m not in _COLORS for m in MODES))]
    colors = mode_colors(names)
    assert set(colors) == set(names)
    rgb = [to_rgb(colors[m]) for m in names]
    assert len(set(rgb)) == len(names), [m for m, c in zip(names, rgb) if rgb.count(c) > 1]
    # a known mode keeps its colour whatever else is in the figure, so figures read alike
    assert mode_colors(["user-mode-0", "none"])["none"] == colors["none"] == _COLORS["none"]
    # group labels are coloured by their mode: two deltas of one mode share it, other modes differ
    g = mode_colors(["user-mode-0 δ=0.02", "user-mode-0 δ=0.05", "user-mode-1 δ=0.02"])
    assert g["user-mode-0 δ=0.02"] == g["user-mode-0 δ=0.05"] != g["user-mode-1 δ=0.02"]
