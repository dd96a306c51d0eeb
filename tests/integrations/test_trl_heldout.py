"""Held-out evaluation and the line per step in TRL runs (pdmask.integrations.trl.heldout, and
examples/trl/train_grpo.py's --eval-every / --eval-prompts / --plain-trl), on the tiny model.

The recorded held-out scores are checked against an independent greedy decode
(``transformers``' own ``generate(do_sample=False)``) of the same prompts; the evaluation must
not change what the run trains; under torchrun only rank 0 evaluates, prints and writes."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="needs the trl extra: pip install -e '.[trl]' (run .ci/trl.sh)")

from pdmask.integrations.trl.heldout import HeldoutCallback, check_result, heldout_callbacks  # noqa: E402
from tests.test_no_machine_paths import MACHINE_PATH  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "trl" / "train_grpo.py"
LINE = re.compile(r"^step (\d+)/(\d+)  reward (\S+)  (kept|clipped) (\d\.\d\d)  heldout (\d\.\d\d) @(\d+) "
                  r"\(step 0: (\d\.\d\d)\)  (\d+\.\d) s/step$")


def example():
    spec = importlib.util.spec_from_file_location("train_grpo_heldout", EXAMPLE)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    return ex


def records(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def independent_scores(ex, prompts: list[str], max_new_tokens: int) -> list[float]:
    """The tiny model's held-out scores at step 0 by transformers' greedy generate, one prompt at a time."""
    model, tok = ex.tiny_model_and_tokenizer()
    model.eval()
    out = []
    for p in prompts:
        ids = torch.tensor([tok(p, add_special_tokens=False).input_ids])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=1, pad_token_id=0)[0, ids.shape[1]:].tolist()
        gen = gen[:gen.index(1)] if 1 in gen else gen
        out.append(ex.reward_letter_a([tok.decode(gen, skip_special_tokens=True)])[0])
    return out


def test_example_records_heldout_accuracy_and_a_line_per_step(tmp_path, capsys):
    ex = example()
    tr = ex.main(["--max-steps", "4", "--eval-every", "3", "--output-dir", str(tmp_path)])
    held = records(tmp_path / "heldout.jsonl")
    assert [h["step"] for h in held] == [0, 3, 4]  # step 0, every 3, and the last
    want = independent_scores(ex, ex.TINY_HELDOUT, ex.TINY["max_completion_length"])
    assert held[0]["scores"] == pytest.approx(want, abs=1e-6)
    assert held[0]["n_prompts"] == len(ex.TINY_HELDOUT) == 16
    for h in held:
        assert h["accuracy"] == pytest.approx(sum(h["scores"]) / len(h["scores"]), abs=1e-6)
        assert 0.0 <= h["finished"] <= 1.0 and h["eval_s"] > 0
    assert held[1]["scores"] != held[0]["scores"]  # the weights moved (lr 1e-2 on the tiny model)
    steps = records(tmp_path / "steps.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    logged = [h for h in tr.state.log_history if "pdmask/kept_frac" in h]
    assert [s["kept"] for s in steps] == [h["pdmask/kept_frac"] for h in logged]
    assert all(s["time_step_s"] > 0 for s in steps)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if LINE.match(ln)]
    assert len(lines) == 4, lines
    m = [LINE.match(ln) for ln in lines]
    assert [x.group(1) for x in m] == ["1", "2", "3", "4"] and {x.group(2) for x in m} == {"4"}
    assert [x.group(7) for x in m] == ["0", "0", "3", "4"]  # the latest evaluation at each step
    assert float(m[-1].group(6)) == pytest.approx(held[-1]["accuracy"], abs=5e-3)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["finished"] is True and run["label"] == "pdm-topk-kl" and run["heldout"]["prompts"] == 16
    assert run["environment"]["packages"]["trl"] and run["wall_s"] > 0
    assert not MACHINE_PATH.search((tmp_path / "run.json").read_text())


def test_the_evaluation_does_not_change_training(tmp_path):
    """Greedy decoding draws no random numbers and leaves the model in train mode: a run with an
    evaluation after every step ends with the same weights, bit for bit, as one without."""
    ex = example()
    a = ex.main(["--max-steps", "2", "--eval-every", "1", "--output-dir", str(tmp_path / "a")])
    b = ex.main(["--max-steps", "2", "--eval-every", "0", "--output-dir", str(tmp_path / "b")])
    assert len(records(tmp_path / "a" / "heldout.jsonl")) == 3 and not (tmp_path / "b" / "heldout.jsonl").exists()
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), n
    assert a.model.training == b.model.training


def test_plain_trl_is_trls_own_trainer(tmp_path, capsys):
    import trl

    ex = example()
    tr = ex.main(["--plain-trl", "--max-steps", "2", "--eval-every", "2", "--eval-prompts", "4",
                  "--output-dir", str(tmp_path)])
    assert type(tr) is trl.GRPOTrainer and type(tr.args) is trl.GRPOConfig
    assert [h["step"] for h in records(tmp_path / "heldout.jsonl")] == [0, 2]
    assert records(tmp_path / "heldout.jsonl")[0]["n_prompts"] == 4
    out = capsys.readouterr().out
    assert sum(1 for ln in out.splitlines() if LINE.match(ln) and " clipped " in ln) == 2
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["label"] == "plain-trl" and run["mask"] is None
    assert run["trainer"] == "trl.trainer.grpo_trainer.GRPOTrainer"


@pytest.mark.parametrize("argv, needle", [
    (["--plain-trl", "--mask-delta", "0.01"], "--mask-delta"),
    (["--plain-trl", "--anchor", "old"], "--anchor"),
    (["--eval-every", "-1"], "--eval-every"),
    (["--eval-prompts", "0"], "--eval-prompts"),
])
def test_bad_flags_are_one_line(argv, needle, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        example().main([*argv, "--output-dir", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "error: " + needle in err[-1]


def test_too_many_eval_prompts(tmp_path):
    with pytest.raises(SystemExit) as e:
        example().main(["--eval-prompts", "17", "--max-steps", "1", "--output-dir", str(tmp_path)])
    assert str(e.value.code) == "--eval-prompts: at most 16 (the held-out problems), got 17"


def test_callback_checks_what_evaluate_returns():
    with pytest.raises(ValueError, match="^every: must be a positive integer"):
        HeldoutCallback(lambda m: {}, every=0)
    for bad, msg in (([1], "must return a mapping"), ({"accuracy": 1.0, "scores": [1.0]}, "lacks finished"),
                     ({"accuracy": 1.0, "finished": 1.0, "scores": []}, "scores must be a non-empty list"),
                     ({"accuracy": float("nan"), "finished": 1.0, "scores": [1.0]}, "accuracy must be a finite number"),
                     ({"accuracy": 1.0, "finished": 1.0, "scores": [float("inf")]}, "scores must be")):
        with pytest.raises(ValueError, match=msg):
            check_result(bad)
    rec = check_result({"accuracy": 0.5, "finished": 1, "scores": [0, 1], "length": 3})
    assert rec == {"accuracy": 0.5, "finished": 1.0, "length": 3.0, "n_prompts": 2, "scores": [0.0, 1.0]}
    line, held = heldout_callbacks(lambda m: {}, every=2)
    assert line.heldout is held and [type(c).__name__ for c in heldout_callbacks(None, every=1)] == ["StepLineCallback"]


def test_two_processes_only_rank0_evaluates_and_writes(tmp_path):
    """torchrun --nproc_per_node 2 (gloo, CPU): one record per evaluation, one line per step."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found next to the interpreter")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [torchrun, "--nproc_per_node", "2", "--master_port", str(29600 + os.getpid() % 1000), str(EXAMPLE),
           "--max-steps", "2", "--eval-every", "1", "--output-dir", str(tmp_path)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert [h["step"] for h in records(tmp_path / "heldout.jsonl")] == [0, 1, 2]
    assert [s["step"] for s in records(tmp_path / "steps.jsonl")] == [1, 2]
    lines = [ln for ln in p.stdout.splitlines() if LINE.match(ln)]
    assert [LINE.match(ln).group(1) for ln in lines] == ["1", "2"], p.stdout[-2000:]
    assert json.loads((tmp_path / "run.json").read_text())["processes"] == 2


def test_the_heldout_problems_are_the_built_in_trainers():
    """The example's held-out problems are those ``pdmask train task=largest shots=1`` holds out
    (its default task_seed and eval_size), and its training problems are none of them."""
    from pdmask.train.config import TrainConfig
    from pdmask.train.tasks import build_task

    ex = example()
    mine = ex.largest_task(64)
    theirs = build_task(TrainConfig(task="largest", shots=ex.SHOTS)).eval
    assert mine.eval == theirs and len(theirs) == TrainConfig().eval_size
    held = {p.prompt for p in theirs}
    assert not any(p.prompt in held for p in mine.train)
    # the run's seed does not change them: the problems come from the task seed alone
    assert ex.largest_task(200).eval == theirs
