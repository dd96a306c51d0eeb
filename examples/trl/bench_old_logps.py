"""What skipping TRL's old-log-prob forward saves, measured side by side.

With ``num_iterations > 1`` (or ``steps_per_generation > gradient_accumulation_steps``, or
TRL's vLLM IS correction on) TRL 1.16 scores every generation batch once more, without
gradients, for ``old_per_token_logps``; the pdmask trainer never reads them and skips that
forward (``PDMaskGRPOTrainer._without_old_logps``). This script trains the same run with
the skip on and off, interleaved in one process (on, off, off, on, ...), so that the load of
a shared machine falls on both alike, and prints each run's ``train()`` wall time, the time
spent inside TRL's scoring forward, and the ratio. The two runs of a pair sample the same
completions (the forward draws no random numbers), so they do the same work but that forward.
The process's CPU time is printed next to the wall time: on a machine shared with other
jobs the wall time of one run can vary by 3x with the load, the CPU time far less.

    python examples/trl/bench_old_logps.py --pairs 2 --max-steps 2      # SmolLM2-135M, the example's settings

docs/trl.md states the measured numbers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_grpo as ex  # noqa: E402

from pdmask.integrations.trl import GRPOConfig, GRPOTrainer  # noqa: E402


def one_run(skip: bool, a, out: Path) -> dict:
    model, tokenizer = ex.load_model(a.model, False)
    r = ex.REAL
    args = GRPOConfig(
        output_dir=str(out), max_steps=a.max_steps, learning_rate=r["learning_rate"], logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, per_device_train_batch_size=r["per_device_batch"],
        num_generations=r["num_generations"], steps_per_generation=r["steps_per_generation"],
        num_iterations=r["num_iterations"], max_completion_length=r["max_completion_length"], bf16=False,
        use_cpu=True, seed=0, mask_mode="pdm-topk-kl", mask_delta_low=r["mask_delta"],
        mask_delta_high=r["mask_delta"], rollout_top_k=20)
    tr = GRPOTrainer(model=model, reward_funcs=ex.reward_first_number, args=args,
                     train_dataset=ex.largest_dataset(ex.largest_task(64).train), processing_class=tokenizer)
    tr._pdmask_skip_old_logps = skip
    spent = []
    scoring = tr._get_per_token_logps_and_entropies

    def timed(*args_, **kw):
        t = time.process_time()
        try:
            return scoring(*args_, **kw)
        finally:
            spent.append(time.process_time() - t)

    tr._get_per_token_logps_and_entropies = timed
    t0, c0 = time.perf_counter(), time.process_time()
    tr.train()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    comp = [h.get("num_tokens") for h in tr.state.log_history if "num_tokens" in h]
    return {"skip": skip, "wall": wall, "cpu": cpu, "forward": sum(spent), "calls": len(spent), "num_tokens": comp}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=2, help="steps per run (num_iterations=2: one generation "
                                                             "batch per two steps)")
    p.add_argument("--out", default="out/bench-old-logps")
    a = p.parse_args(argv)
    runs = []
    for i in range(a.pairs):
        for skip in ((True, False) if i % 2 == 0 else (False, True)):
            r = one_run(skip, a, Path(a.out) / f"{i}-{skip}")
            runs.append(r)
            print(f"pair {i} skip={skip!s:5}: train() {r['wall']:7.1f} s wall, {r['cpu']:7.1f} s CPU; TRL scoring "
                  f"forward {r['forward']:6.2f} s CPU in {r['calls']} call(s); tokens {r['num_tokens']}", flush=True)
    fwd = [r["forward"] for r in runs if not r["skip"]]
    for key in ("cpu", "wall"):
        on = [r[key] for r in runs if r["skip"]]
        off = [r[key] for r in runs if not r["skip"]]
        print(f"{key:4}: skip on mean {statistics.mean(on):.1f} s per run ({', '.join(f'{x:.1f}' for x in on)}), "
              f"off {statistics.mean(off):.1f} s ({', '.join(f'{x:.1f}' for x in off)}); ratio on/off "
              f"{statistics.mean(on) / statistics.mean(off):.3f}, pairwise "
              + ", ".join(f"{x / y:.3f}" for x, y in zip(on, off)))
    print(f"the old-log-prob forward itself: {statistics.mean(fwd):.2f} s CPU per run (skip off)")


if __name__ == "__main__":
    main()
