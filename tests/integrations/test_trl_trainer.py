"""The pdmask GRPOTrainer on CPU with a tiny local model: every mode trains, the captured
mu is the generator's distribution (through TRL's shuffling and splitting), and the loss
equals pdmask.policy_loss on the same tensors with TRL's normalisation."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="needs the trl extra: pip install -e '.[trl]' (run .ci/trl.sh)")
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import trl_helpers as H  # noqa: E402

from tests.numerics import one_thread  # noqa: E402

import pdmask  # noqa: E402
from pdmask.integrations.trl import GRPOConfig, options  # noqa: E402

#: every mode the trainer accepts (read from the registry), each with one of TRL's aggregations in turn
MODES = {m: ("dapo", "bnpo", "grpo", "dr_grpo")[i % 4] for i, m in enumerate(options.accepted_modes())}
#: the modes that need no top-K
BINARY = tuple(m for m in MODES if "topk" not in pdmask.MODES[m].needs)


def _check_records(tr, k):
    assert tr.records, "the loss was never computed"
    T = tr.args.temperature
    for rec in tr.records:
        assert torch.isfinite(rec["loss"])
        torch.testing.assert_close(rec["loss"], rec["expected"], atol=1e-6, rtol=1e-5)
        inp, m = rec["inputs"], rec["mask"]
        assert inp["sampled_logprob"].shape == m.shape
        if k:
            assert inp["topk_ids"].shape == m.shape + (k,)
        if rec["on_policy"]:
            # no update since generation: the captured mu is the model's softmax(logits / T)
            lq = torch.log_softmax(rec["logits"] / T, -1)
            s_lp = lq.gather(-1, inp["completion_ids"][..., None]).squeeze(-1)
            torch.testing.assert_close(inp["sampled_logprob"][m], s_lp[m], atol=2e-5, rtol=0)
            if k:
                torch.testing.assert_close(inp["topk_logprobs"][m], lq.topk(k, -1).values[m],
                                           atol=2e-5, rtol=0)
                torch.testing.assert_close(inp["topk_logprobs"][m],
                                           lq.gather(-1, inp["topk_ids"])[m], atol=2e-5, rtol=0)


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_trains(tmp_path, mode):
    k = 0 if mode in BINARY else 4
    tr = H.make_trainer(tmp_path, mask_mode=mode, rollout_top_k=k, loss_type=MODES[mode])
    before = [p.detach().clone() for p in tr.model.parameters()]
    tr.train()
    _check_records(tr, k)
    assert len(tr.records) == 2 and tr.records[0]["on_policy"] and not tr.records[1]["on_policy"]
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters())), "no parameter moved"
    logs = [h for h in tr.state.log_history if "pdmask/kept_frac" in h]
    assert len(logs) == 2
    for h in logs:
        assert 0.0 <= h["pdmask/kept_frac"] <= 1.0 and h["pdmask/num_tokens"] > 0
    # on-policy: mu == pi, so no divergence and nothing out of region
    assert tr.records[0]["metrics"]["divergence_max"] < 1e-5
    assert bool(tr.records[0]["kept"].all())


@pytest.mark.parametrize("loss_type,ga", [("dapo", 2), ("dr_grpo", 2)])
def test_loss_matches_core_with_trl_normalisation(tmp_path, loss_type, ga):
    tr = H.make_trainer(tmp_path, loss_type=loss_type, gradient_accumulation_steps=ga, max_steps=2 // ga,
                        steps_per_generation=2, per_device_train_batch_size=4, mask_mode="pdm-topk-kl")
    tr.train()
    assert len(tr.records) == 2 and all(r["on_policy"] for r in tr.records)  # one update after both
    _check_records(tr, 4)


def test_mask_fires_off_policy(tmp_path):
    tr = H.make_trainer(tmp_path, mask_mode="pdm-topk-kl", mask_delta_low=1e-4, mask_delta_high=1e-4,
                        learning_rate=0.1, max_steps=4, steps_per_generation=4)
    tr.train()
    _check_records(tr, 4)
    off = [r for r in tr.records if not r["on_policy"]]
    assert off and any(float(r["metrics"]["out_of_region_frac"]) > 0 for r in off)
    assert any(not bool(r["kept"][r["mask"]].all()) for r in off), "no token was ever masked"


def _counting_scoring_forwards(tr) -> list:
    """Count the calls of TRL's scoring forward (old / reference log-probs; nothing else calls it
    here: the loss has its own forward)."""
    calls, orig = [], tr._get_per_token_logps_and_entropies

    def counting(*a, **kw):
        calls.append(a[0] if a else kw.get("model"))
        return orig(*a, **kw)

    tr._get_per_token_logps_and_entropies = counting
    return calls


def test_trls_old_logprob_forward_is_skipped(tmp_path):
    """num_iterations=2: TRL would score the generation batch once more for old_per_token_logps,
    which the loss never reads. Skipped, the losses are the same to the bit and the forward is gone."""
    # one thread: the loss is compared bit for bit, so both runs must reduce in the same order
    with one_thread():
        runs = {skip: _records_with_skip(tmp_path, skip) for skip in (True, False)}
    for a, b in zip(runs[True], runs[False], strict=True):
        assert torch.equal(a["loss"], b["loss"])
    assert float(runs[True][1]["metrics"]["kept_frac"]) < 1.0  # the second pass is off-policy: the mask acted


def _records_with_skip(tmp_path, skip: bool) -> list:
    """The records of a 2-step run with TRL's old-log-prob forward skipped or not, checked."""
    tr = H.make_trainer(tmp_path / str(skip), mask_mode="pdm-topk-kl", num_iterations=2, steps_per_generation=1,
                        mask_delta_low=1e-3, mask_delta_high=1e-3, learning_rate=0.1, max_steps=2)
    tr._pdmask_skip_old_logps = skip
    calls = _counting_scoring_forwards(tr)
    tr.train()
    _check_records(tr, 4)
    assert len(tr.records) == 2
    assert tr.num_iterations == 2 and tr.vllm_importance_sampling_correction is True  # restored
    assert len(calls) == (0 if skip else 1), calls  # one generation batch: TRL scores it once
    assert ("old_per_token_logps" in tr.records[0]["inputs"]) is not skip
    return tr.records


def test_vllm_path_picks_the_sampled_token(tmp_path):
    tr = H.make_trainer(tmp_path, mask_mode="pdm-topk-kl", rollout_top_k=3, max_steps=2)
    tr.use_vllm = True  # route generation through the (fake) vLLM backend
    tr.vllm_generation = H.FakeVLLMGeneration(tr, logprobs=3)
    tr._last_loaded_step = -1
    calls = _counting_scoring_forwards(tr)
    tr.train()
    assert not calls  # TRL's vLLM IS correction (on by default) would score the batch for old log-probs
    assert tr.vllm_generation.synced >= 1
    _check_records(tr, 3)
    # the fake really produced K + 1 entries where the sampled token fell outside the
    # top-K, and rank-1 != sampled somewhere: TRL's lp[0] would have been wrong there
    outs = tr.vllm_generation.outputs
    sizes = {len(d) for o in outs for d in o.outputs[0].logprobs}
    assert sizes <= {3, 4}
    lps, ids = H.trl_extract(outs)
    wrong = [row_ids[0] != s for o, seq in zip(outs, ids) for row_ids, s in zip(seq, o.outputs[0].token_ids)]
    assert any(wrong), "every sampled token was the rank-1 token; the test would not catch lp[0]"


@pytest.mark.parametrize("kw,match", [
    ({"mask_mode": "pdm-full-kl"}, "full logits"),
    ({"mask_mode": "nope"}, "^mask_mode: unknown value 'nope'; valid values are: grpo"),
    ({"mask_mode": "pdm-topk-kl", "rollout_top_k": 0}, "K >= 1"),
    ({"loss_type": "cispo", "mask_mode": "spo"}, "loss_type"),
    ({"beta": 0.04, "top_p": 0.9}, "beta"),
    ({"mask_estimator": "magic"}, "mask_estimator"),
    ({"mask_delta_low": -1.0}, "mask_delta_low"),
    ({"is_cap": 0.0}, "is_cap"),
])
def test_config_rejects(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        H.config(tmp_path, **kw)


def test_trainer_needs_pdmask_config(tmp_path):
    import trl
    from datasets import Dataset
    from tiny_lm import tiny_model, tiny_tokenizer

    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="^args:"):
        H.GRPOTrainer(model=tiny_model(), reward_funcs=H.reward_letter_a, args=args,
                      train_dataset=Dataset.from_dict({"prompt": ["a"]}), processing_class=tiny_tokenizer())


def test_unsupported_trl_version_fails_clearly(monkeypatch):
    import trl

    import pdmask.integrations.trl as mod

    monkeypatch.setattr(trl, "__version__", "1.17.0")
    monkeypatch.delenv("PDMASK_TRL_ALLOW_UNSUPPORTED", raising=False)
    with pytest.raises(ImportError, match=r"supports trl>=1.16,<1.17.*found trl 1.17.0"):
        importlib.reload(mod)
    monkeypatch.setenv("PDMASK_TRL_ALLOW_UNSUPPORTED", "1")
    with pytest.warns(RuntimeWarning, match="found trl 1.17.0"):
        importlib.reload(mod)
    monkeypatch.setattr(trl, "__version__", "1.16.0")
    importlib.reload(mod)
    assert mod.TRL_VERSION == "1.16.0"


@pytest.mark.slow
def test_two_processes_gloo(tmp_path):
    """torchrun --nproc_per_node 2 on CPU (gloo): both ranks train, and DDP keeps them in sync."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found next to the interpreter")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parents[1] / "src"), str(HERE)]),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [torchrun, "--nproc_per_node", "2", "--master_port", str(29500 + os.getpid() % 1000),
           str(HERE / "trl_ddp_run.py"), str(tmp_path)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in res] == [2, 2] and [r["rank"] for r in res] == [0, 1]
    assert res[0]["backend"] == "gloo"
    assert res[0]["param_sum"] == pytest.approx(res[1]["param_sum"], abs=0, rel=0)  # DDP-synced weights
    assert res[0]["param_sum"] != pytest.approx(res[0]["param_sum_before"], abs=1e-9)  # and they moved
    assert res[0]["local_completions"] != res[1]["local_completions"]  # each rank generated its own
    for r in res:
        assert r["n_steps_logged"] == 2 and all(r["loss_matches"])
    # counts are summed over ranks in the logged metrics
    assert res[0]["logged_num_tokens"] == res[0]["local_num_tokens"] + res[1]["local_num_tokens"]


def test_example_script_runs(tmp_path, capsys):
    """The copy-paste example in docs/trl.md (its main(), one process, one step)."""
    spec = importlib.util.spec_from_file_location("train_grpo", HERE.parents[1] / "examples" / "trl" / "train_grpo.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    ex.main(["--max-steps", "1", "--mask-mode", "dppo-topk-tv", "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "step 1: loss" in out and "kept 1.000" in out  # one on-policy step: nothing masked


def test_finish_and_exit(tmp_path):
    """Single process (no process group): returns. With a process group: waits, ends training,
    flushes and leaves with os._exit(code) -- checked in a child process with a one-rank gloo group."""
    from pdmask.integrations.trl import finish_and_exit

    assert finish_and_exit(object()) is None
    code = (
        "import sys, torch.distributed as dist\n"
        "from pdmask.integrations.trl import finish_and_exit\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/pg', rank=0, world_size=1)\n"
        "class Acc:\n"
        "    def wait_for_everyone(self): print('waited', flush=True)\n"
        # not flushed here: it reaches the pipe only if finish_and_exit flushes before os._exit
        "    def end_training(self): print('ended'); dist.destroy_process_group()\n"
        "class T: accelerator = Acc()\n"
        "finish_and_exit(T(), code=3)\n"
        "print('not reached')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parents[1] / "src"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stderr[-2000:]
    assert p.stdout.split() == ["waited", "ended"], p.stdout
