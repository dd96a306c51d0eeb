"""One GRPO trainer step on SmolLM2-135M per trainable-parameter variant, side by side in one run.

    PYTHONPATH=src python benchmarks/bench_real_step.py --out docs/results/real-lm/step-bench
    PYTHONPATH=src python benchmarks/bench_real_step.py --prompts 2 --group 4 --variants full,lora   # a quick look

configs/real.yaml's settings (SmolLM2-135M-Instruct, V = 49152, the `largest` task through
the chat template, bf16 hf engine with shared prefill, 16 new tokens, one mini-batch) at a
reduced batch (``--prompts`` x ``--group``). It runs the trainer's own pieces (``setup``,
``rollout_step``, ``select``, ``trainer_forward``, ``forward_loss``, ``engine_state_dict``)
in the order of the loop, timing each phase:

- ``sync``: ``engine.load_weights(engine_state_dict(model))``, which merges LoRA first;
- ``generate``: ``rollout_step``, that is, the engine's sampling, the rewards and the
  advantages. The engine's log-probs (sampled token, top-K) come with generation: the
  hf engine takes them from the same logits it samples from, so there is no separate pass;
- ``forward``: the trainer forward (logits, or final hidden states with ``loss_from=hidden``);
- ``loss``: the policy loss on it (with ``hidden``: the chunked vocabulary reduction);
- ``backward``: ``loss.backward()`` (with ``hidden``: the logits recomputed chunk by chunk);
- ``optimizer``: the grad-norm clip and the AdamW step.

Each variant runs in a fresh child process (``--child``), one after the other, so that
no variant's memory peak hides another's. The child takes ``--warmup`` full steps
(allocations, AdamW state), then times ``--steps`` steps, the same step indices in every
variant. Memory is the child's resident set: after ``setup`` (model, engine, prompts), and
its high-water mark during the timed steps. The mark is reset after setup by writing
``5`` to ``/proc/self/clear_refs``, where Linux allows it; otherwise it is ``ru_maxrss``
over the whole process, and the record says so. Ratios are per phase, against
``full (logits)``. Times are the mean over the timed steps.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import reset_peak, status_mib  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

#: name -> config overrides (train_blocks / lora_* / loss_from); the first is the baseline of the ratios
VARIANTS = {
    "full (logits)": {},
    "full (hidden)": {"loss_from": "hidden"},
    "top-4 blocks": {"train_blocks": 4},
    "top-4 blocks (hidden)": {"train_blocks": 4, "loss_from": "hidden"},
    "LoRA r=8": {"lora_rank": 8, "lora_alpha": 16.0},
    "LoRA r=8 (hidden)": {"lora_rank": 8, "lora_alpha": 16.0, "loss_from": "hidden"},
    "LoRA r=8 + top-4": {"lora_rank": 8, "lora_alpha": 16.0, "train_blocks": 4},
}
SHORT = {"full": "full (logits)", "full-hidden": "full (hidden)", "top": "top-4 blocks",
         "top-hidden": "top-4 blocks (hidden)", "lora": "LoRA r=8", "lora-hidden": "LoRA r=8 (hidden)",
         "lora-top": "LoRA r=8 + top-4"}
PHASES = ("sync", "generate", "forward", "loss", "backward", "optimizer")


# ------------------------------------------------------------------ memory of this process
def mem_mb(key: str) -> float:
    """``VmRSS`` or ``VmHWM`` (the peak) of this process in MiB; the peak (``ru_maxrss``) where
    /proc cannot be read."""
    mib = status_mib(key)
    return mib if mib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------ one variant (child process)
def child(name: str, args) -> dict:
    import torch

    from pdmask.train.config import load_config
    from pdmask.train.grpo import rollout_seed, setup, step_prompts
    from pdmask.train.model import num_params
    from pdmask.train.rollout import rollout_step
    from pdmask.train.trainable import engine_state_dict, trainable_parameters
    from pdmask.train.update import forward_loss, select, trainer_forward

    over = {"prompts_per_step": args.prompts, "group_size": args.group, "threads": args.threads,
            "progress": False, "minibatches": 1, **VARIANTS[name]}
    if args.model:
        over["model_path"] = args.model
    cfg = load_config(args.config, over)
    S = setup(cfg)
    model, opt, engine = S.model, S.optimizer, S.engine
    answers = [p.answer for p in S.task.train]
    after_setup = mem_mb("VmRSS")
    exact_peak = False
    times = {p: [] for p in PHASES}
    tokens, prompt_tokens = [], []
    for step in range(args.warmup + args.steps):
        timed = step >= args.warmup
        if timed and step == args.warmup:
            exact_peak = reset_peak()  # the timed steps' own peak, not setup's
        t = {}
        t0 = time.perf_counter()
        if step > 0:  # the loop's sync (sync_every = 1): none before the first step
            engine.load_weights(engine_state_dict(model))
        t["sync"] = time.perf_counter() - t0
        pidx = step_prompts(step, cfg, len(S.train_ids))
        t0 = time.perf_counter()
        ro = rollout_step(engine, S.tokenizer, [S.train_ids[i] for i in pidx], [answers[i] for i in pidx],
                          S.reward_fn, group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
                          seed=rollout_seed(cfg, step), std_norm=cfg.adv_std_norm)
        t["generate"] = time.perf_counter() - t0
        b = ro.batch
        plens, rlens = b.attention_mask[:, :b.prompt_len].sum(1).tolist(), b.response_mask.sum(1).tolist()
        idx = list(range(len(rlens)))
        sub = select(b, idx, plens, rlens)  # one mini-batch (real.yaml: minibatches = 1)
        t0 = time.perf_counter()
        x = trainer_forward(model, sub, cfg)  # (B, T, V) logits or (B, T, H) hidden states
        t1 = time.perf_counter()
        out = forward_loss(model, x, sub, ro.advantages[idx], cfg)
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        t3 = time.perf_counter()
        params = [p for g in opt.param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)  # as update_step
        opt.step()
        t4 = time.perf_counter()
        t.update(forward=t1 - t0, loss=t2 - t1, backward=t3 - t2, optimizer=t4 - t3)
        del x, out
        if timed:
            for p in PHASES:
                times[p].append(t[p])
            tokens.append(sum(rlens))
            prompt_tokens.append(sum(plens))
        print(f"  {name} step {step}{'' if timed else ' (warm-up)'}: "
              + ", ".join(f"{p} {t[p]:.2f}s" for p in PHASES), file=sys.stderr, flush=True)
    mean = {p: sum(v) / len(v) for p, v in times.items()}
    return {"variant": name, "overrides": VARIANTS[name], "num_params": num_params(model),
            "num_trainable_params": sum(p.numel() for p in trainable_parameters(model)),
            **{f"{p}_s": mean[p] for p in PHASES}, "step_s": sum(mean.values()),
            "rss_after_setup_mb": after_setup, "peak_rss_mb": mem_mb("VmHWM"), "peak_is_of_timed_steps": exact_peak,
            "response_tokens": tokens, "prompt_tokens": prompt_tokens, "vocab_size": model.config.vocab_size,
            "threads": torch.get_num_threads()}


# ------------------------------------------------------------------ the table (parent)
def table(rows: list[dict]) -> str:
    base = rows[0]
    head = ("| variant | trained params | " + " | ".join(f"{p} s" for p in PHASES)
            + " | step s | step x | fwd+loss+bwd+opt x | peak RSS MB | peak x | peak - setup MB |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]

    def train_s(r):
        return r["forward_s"] + r["loss_s"] + r["backward_s"] + r["optimizer_s"]

    for r in rows:
        cells = [r["variant"], f"{r['num_trainable_params'] / 1e6:.2f} M"]
        cells += [f"{r[p + '_s']:.2f} ({r[p + '_s'] / base[p + '_s']:.2f}x)" if base[p + "_s"] > 0
                  else f"{r[p + '_s']:.2f}" for p in PHASES]
        cells += [f"{r['step_s']:.1f}", f"{r['step_s'] / base['step_s']:.2f}", f"{train_s(r) / train_s(base):.2f}",
                  f"{r['peak_rss_mb']:.0f}", f"{r['peak_rss_mb'] / base['peak_rss_mb']:.2f}",
                  f"{r['peak_rss_mb'] - r['rss_after_setup_mb']:.0f}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "real.yaml"))
    ap.add_argument("--model", default="", help="model_path override (default: the config's, smollm2-135m)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per variant (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (allocations, AdamW state)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", default=",".join(SHORT), help=f"comma list of: {', '.join(SHORT)}")
    ap.add_argument("--out", default="", help="write bench.json and bench.md here")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args)), flush=True)
        return
    names = []
    for v in args.variants.split(","):
        if v.strip() not in SHORT:
            raise SystemExit(f"error: --variants: unknown variant {v.strip()!r}; valid: {', '.join(SHORT)}")
        names.append(SHORT[v.strip()])
    if names[0] != "full (logits)":
        names.insert(0, "full (logits)")  # the baseline of every ratio
    from pdmask.train.environment import environment, one_line

    t_run = time.time()
    rows = []
    for name in names:
        cmd = [sys.executable, __file__, "--child", name, "--config", args.config, "--prompts", str(args.prompts),
               "--group", str(args.group), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--threads", str(args.threads)] + (["--model", args.model] if args.model else [])
        p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            raise SystemExit(f"error: variant {name!r} failed (exit {p.returncode})")
        rows.append(json.loads(line[len("RESULT "):]))
        print(f"{name}: step {rows[-1]['step_s']:.1f} s, peak RSS {rows[-1]['peak_rss_mb']:.0f} MB", flush=True)
    env = environment(args.threads)
    cmd = "PYTHONPATH=src python benchmarks/bench_real_step.py " + " ".join(
        a for a in (sys.argv[1:] if argv is None else argv))
    md = [f"# One trainer step on SmolLM2-135M per trainable-parameter variant", "",
          f"Written by `{cmd}` ({time.time() - t_run:.0f} s).", "",
          f"{Path(args.config).name} at {args.prompts} prompts x {args.group} samples, one mini-batch, "
          f"{args.warmup} warm-up step(s), then the mean of {args.steps} timed step(s); every variant in its own "
          "process, one after the other. Ratios (x) are to `full (logits)`. The engine's log-probs come with "
          "`generate` (the hf engine reports them from the logits it samples from). Peak RSS is the "
          "resident-set high-water mark of the timed steps"
          + ("" if all(r["peak_is_of_timed_steps"] for r in rows) else " (of the whole process: the reset was "
             "not available)") + "; `peak - setup` is its growth over the RSS after setup (model, engine copy).",
          "", table(rows), "",
          "Response tokens of the timed steps: " + "; ".join(f"{r['variant']} {r['response_tokens']}" for r in rows)
          + ".", "", one_line(env), ""]
    text = "\n".join(md)
    print("\n" + text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps({"command": cmd, "rows": rows, "environment": env}, indent=1))
        (out / "bench.md").write_text(text)


if __name__ == "__main__":
    main()
