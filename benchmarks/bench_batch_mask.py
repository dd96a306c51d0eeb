"""CPU micro-benchmark: one batch-aware mask computation vs a plain dppo-topk-kl loss
forward + backward, on the built-in model of configs/main.yaml, measured side by side.

    PYTHONPATH=src python benchmarks/bench_batch_mask.py              # 10 interleaved rounds
    PYTHONPATH=src python benchmarks/bench_batch_mask.py --quick      # 3 rounds
    PYTHONPATH=src python benchmarks/bench_batch_mask.py --config configs/stress.yaml --batch 16

The batch has the shape of one trainer mini-batch of the preset (prompts_per_step *
group_size / minibatches sequences, a prompt of --prompt-len tokens, max_new_tokens
response tokens); tokens are random and the rollout policy is the model's own logits plus
noise (the cost does not depend on the values). AdamW has taken two steps, so its state
(and hence P) is real.

Rows:
  dppo-topk-kl    trainer forward -> policy_loss(mode="dppo-topk-kl") -> backward: the baseline
  batch-all       batch_mask(params="all"): forward + backward of Phi + one forward-mode JVP
  batch-last-N    batch_mask(params=N): the last N blocks + norm + head; forward mode
                  replays the top blocks only (method "jvp-top")
  (dbl-bwd)       --all-methods: the same by the double backward (the fallback method)

``x dppo`` is the mask's own time over the baseline's (minimum over interleaved rounds);
``step x`` is (mask + baseline) / baseline: the update's cost when the mask is computed
before the loss on a separate forward, which is what a trainer mode would pay today (a
shared forward would save one model forward). The optimizer step and the rollout are
not included in either.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import env_line, interleaved_times, summary  # noqa: E402

import pdmask  # noqa: E402
from pdmask_lab.batchmask import batch_mask  # noqa: E402
from pdmask.engine.hf import response_logits  # noqa: E402
from pdmask.train.config import load_config  # noqa: E402
from pdmask.train.model import build_model, num_params  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def make_batch(model, cfg, B: int, P: int, T: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    V = cfg.vocab_size
    ids = torch.randint(2, V, (B, P + T), generator=g)
    am = torch.ones(B, P + T, dtype=torch.bool)
    am[: B // 2, : P // 4] = False  # some left padding
    rmask = torch.ones(B, T, dtype=torch.bool)
    rmask[: B // 3, T // 2:] = False  # some short responses
    am[:, P:] = rmask
    with torch.no_grad():
        z = response_logits(model, ids, am, P).float()
    logmu = torch.log_softmax((z + 0.3 * torch.randn(z.shape, generator=g)) / cfg.loss.sampling.temperature, -1)
    top = logmu.topk(cfg.top_k, -1)
    adv = torch.randn(B, generator=g)
    return dict(input_ids=ids, attention_mask=am, response_mask=rmask,
                rollout_logprob=logmu.gather(-1, ids[:, P:, None])[..., 0], rollout_topk_ids=top.indices,
                rollout_topk_logprobs=top.values, advantages=adv)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "main.yaml"))
    ap.add_argument("--batch", type=int, default=None, help="sequences (default: the preset's mini-batch)")
    ap.add_argument("--prompt-len", type=int, default=28, help="prompt tokens (the arithmetic prompts are ~25-30)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="3 rounds")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the preset's)")
    ap.add_argument("--all-methods", action="store_true",
                    help="also time each variant with the method that method='auto' does not pick")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    torch.set_num_threads(args.threads or cfg.threads)
    B = args.batch or cfg.prompts_per_step * cfg.group_size // cfg.minibatches
    P, T = args.prompt_len, cfg.max_new_tokens
    model = build_model(cfg, cfg.vocab_size, pad_id=0, eos_id=1, seed=0)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
    batch = make_batch(model, cfg, B, P, T)
    rollout = pdmask.Rollout(batch["input_ids"][:, P:], batch["rollout_logprob"], batch["rollout_topk_ids"],
                             batch["rollout_topk_logprobs"], batch["response_mask"])
    sampling = cfg.loss.sampling
    ids, am, adv = batch["input_ids"], batch["attention_mask"], batch["advantages"]
    # delta at the 80th percentile of the top-K KL: ~20% of the tokens out of region (a
    # fresh model is near uniform, so the preset's delta would leave O empty)
    st = pdmask.token_stats(response_logits(model, ids, am, P).detach(), rollout, sampling=sampling)
    delta = float(st["topk_kl"][batch["response_mask"]].quantile(0.8))
    thresholds = pdmask.Thresholds(delta, delta)
    kw = dict(sampling=sampling, is_cap=cfg.loss.corrections.is_cap, thresholds=thresholds)

    def dppo():
        logits = response_logits(model, batch["input_ids"], batch["attention_mask"], P)
        out = pdmask.policy_loss(logits, rollout, adv, mode="dppo-topk-kl", validate=False,
                                 thresholds=thresholds, sampling=sampling,
                                 corrections=cfg.loss.corrections)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()

    for _ in range(2):  # a real AdamW state for the preconditioner
        dppo()
        opt.step()
    opt.zero_grad(set_to_none=True)

    def bm(params, method):
        return lambda: batch_mask(model, ids, am, rollout, adv, params=params, optimizer=opt, method=method,
                                  validate=False, **kw)

    fns = {"dppo-topk-kl": dppo}
    L = cfg.num_layers
    lasts = sorted({1, max(1, L // 2)})
    fns["batch-all (jvp)"] = bm("all", "jvp")
    for n in lasts:
        fns[f"batch-last-{n} (jvp-top)"] = bm(n, "jvp")
    if args.all_methods:  # the method "auto" does not choose
        fns["batch-all (dbl-bwd)"] = bm("all", "double-backward")
        for n in lasts:
            fns[f"batch-last-{n} (dbl-bwd)"] = bm(n, "double-backward")
    probe = batch_mask(model, ids, am, rollout, adv, optimizer=opt, **kw)
    rounds = 3 if args.quick else args.rounds
    print(f"# {env_line()}; model {cfg.arch} {num_params(model):,} params ({L} blocks, d={cfg.hidden_size}, "
          f"V={cfg.vocab_size}); batch B={B} P={P} T={T} K={cfg.top_k}; {int(probe.metrics['num_out_of_region'])} "
          f"of {int(probe.metrics['num_tokens'])} tokens out of region (delta {delta:.3g}); "
          f"{rounds} interleaved rounds", flush=True)
    res = interleaved_times(fns, rounds)
    base = summary(res["dppo-topk-kl"])[0]
    print(f"{'row':<28}{'min ms':>10}{'median ms':>12}{'x dppo':>9}{'step x':>9}")
    for name, ts in res.items():
        lo, med = summary(ts)
        step = "" if name == "dppo-topk-kl" else f"{(lo + base) / base:9.2f}"
        print(f"{name:<28}{1e3 * lo:10.1f}{1e3 * med:12.1f}{lo / base:9.2f}{step:>9}", flush=True)


if __name__ == "__main__":
    main()
