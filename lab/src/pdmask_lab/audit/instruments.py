"""Step-free first-order instruments in parameter space.

For a token t of sequence b, with ``L_t = A_t log pi_t(k_t)`` (the token's own objective;
its update is ``theta += eta w grad L_t``, ``w > 0`` the detached IS weight) and ``D_t``
the proximity divergence at t (the same rollout view of mu):

    s_t   = <grad_theta D_t, grad_theta L_t>        the first-order change of D_t along
                                                    the token's own gradient step
    s^P_t = <grad_theta D_t, P grad_theta L_t>      the same through the optimizer's
                                                    preconditioner P (what the trainer's
                                                    next update made of token t does)

both exact (autograd, float64; no step length, no finite difference). A criterion c is
*right* on t when ``sign(A_t c_t) = sign(s_t)``.

**P** (the trainer's AdamW, from an optimizer state): per parameter coordinate,

    P = lr (1 - b1) / (1 - b1^(n+1)) / ( sqrt( b2 v / (1 - b2^(n+1)) ) + eps )

with ``v`` = ``exp_avg_sq`` and ``n`` = ``step`` of the state: the weight of a gradient
``g`` in the next step's bias-corrected first moment over the bias-corrected second
moment that step would use for a vanishing ``g`` (the linearisation of AdamW's next
update at ``g = 0``; the momentum and the decoupled weight decay do not depend on ``g``).
It is :func:`pdmask_lab.batchmask.precondition.preconditioner`'s ``P``, shared with the
batch-aware mask. A fresh state gives ``P = lr / eps`` (a multiple of the identity).

**Groups.** ``s`` splits into the output layer (``head``), the input embedding
(``embed``), everything else (``body``) and, for tied embeddings, a ``cross`` term. A
tied matrix W is used twice: its gradient is the sum of a part through the embedding
lookup (``g_emb``: the gradient at the embedding's output, scattered back to the rows
of the looked-up ids) and a part through the output projection (``g_head = g_W -
g_emb``). Then

    <g^D_W, g^L_W> = <g^D_emb, g^L_emb> + <g^D_head, g^L_head>
                     + (<g^D_emb, g^L_head> + <g^D_head, g^L_emb>)      [cross]

so ``head + embed + body + cross = s`` exactly (cross = 0 when untied). ``head`` alone is
the first-order change of a step that moves only the output layer's role: for an untied
head it equals ``A_t |h_t|^2 Ddot_t / T^2`` (``h_t`` the final hidden state), the
logit-space prediction, which the tests check.
"""

from __future__ import annotations

import torch

from .steps import Forward, trainable

GROUPS = ("head", "embed", "body", "cross")
F64 = torch.float64


class _Roles:
    """Which trainable parameters are the output layer, the input embedding, the body."""

    def __init__(self, model: torch.nn.Module, params: list[torch.Tensor]):
        ids = {id(p): i for i, p in enumerate(params)}

        def of(getter):
            mod = getattr(model, getter)() if callable(getattr(model, getter, None)) else None
            return mod, ([ids[id(p)] for p in mod.parameters() if id(p) in ids] if mod is not None else [])

        self.head_mod, head = of("get_output_embeddings")
        self.emb_mod, emb = of("get_input_embeddings")
        self.shared = sorted(set(head) & set(emb))  # tied: the same tensor in both roles
        self.head = [i for i in head if i not in self.shared]
        self.embed = [i for i in emb if i not in self.shared]
        if len(self.shared) > 1:
            raise ValueError("model: more than one parameter is shared by the input embedding and the output layer")
        if self.shared and not isinstance(self.emb_mod, torch.nn.Embedding):
            raise ValueError(f"model: tied embeddings need the input embedding to be a torch.nn.Embedding, "
                             f"got {type(self.emb_mod).__name__}")
        taken = set(head) | set(emb)
        self.body = [i for i in range(len(params)) if i not in taken]

    @property
    def tied(self) -> bool:
        return bool(self.shared)


def _dot(a: torch.Tensor, b: torch.Tensor, p=None) -> torch.Tensor:
    if p is None:
        return (a.to(F64) * b.to(F64)).sum()
    return (a.to(F64) * (p * b.to(F64) if isinstance(p, torch.Tensor) else float(p) * b.to(F64))).sum()


def split(gD: list, gL: list, roles: _Roles, *, emb_D=None, emb_L=None, P: list | None = None) -> dict:
    """The group terms of ``<gD, P gL>`` (P = None: the identity).

    ``emb_D`` / ``emb_L``: the embedding-lookup part of the shared matrix's gradient
    (tied only). Returns ``{head, embed, body, cross}`` as 0-dim float64 tensors."""
    pi = (lambda i: None) if P is None else (lambda i: P[i])  # noqa: E731
    z = torch.zeros((), dtype=F64)
    out = {"head": sum((_dot(gD[i], gL[i], pi(i)) for i in roles.head), z),
           "embed": sum((_dot(gD[i], gL[i], pi(i)) for i in roles.embed), z),
           "body": sum((_dot(gD[i], gL[i], pi(i)) for i in roles.body), z), "cross": z.clone()}
    for i in roles.shared:
        hD, hL = gD[i] - emb_D, gL[i] - emb_L  # the output-projection role
        out["embed"] = out["embed"] + _dot(emb_D, emb_L, pi(i))
        out["head"] = out["head"] + _dot(hD, hL, pi(i))
        out["cross"] = out["cross"] + _dot(emb_D, hL, pi(i)) + _dot(hD, emb_L, pi(i))
    return out


def token_objectives(z: torch.Tensor, rb, b: int, t: int, divergence: str,
                     temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``(D_t, log pi_t(k_t))`` from one position's logits ``z`` (V,).

    The same formulas as :func:`pdmask.token_stats` (which returns D detached): the top-K
    divergences through :func:`pdmask.divergences.build_support` (S' = top-K of mu plus
    the sampled token, one tail bucket), the full ones over the vocabulary with mu =
    ``softmax(rb.rollout.logits / T)`` (logs floored as there). Tested equal to ``token_stats``."""
    from pdmask import divergences as divs

    dt = z.dtype
    logq = torch.log_softmax(z / temperature, -1)  # (V,)
    k = rb.response_ids[b, t].long()
    logp = logq[k]
    if divergence.startswith("topk"):
        ids = rb.rollout.topk_ids[b, t].long()
        sup = divs.build_support(k[None], logp[None], rb.rollout.sampled_logprob[b, t].to(dt)[None], ids[None],
                                 logq[ids][None], rb.rollout.topk_logprobs[b, t].to(dt)[None], (logq.exp() ** 2).sum()[None],
                                 z.shape[-1])
        D = divs.topk_kl(sup) if divergence == "topk_kl" else divs.topk_tv(sup)
        return D[0], logp
    logm = torch.log_softmax(rb.rollout.logits[b, t].to(dt) / temperature, -1)
    m = logm.exp()
    if divergence == "full_kl":
        kl = torch.where(m > 0, m * (divs.floor_log(logm) - divs.floor_log(logq)), torch.zeros_like(m))
        return kl.sum().clamp(min=0.0), logp
    return 0.5 * (logq.exp() - m).abs().sum(), logp


def optimizer_preconditioner(params: list[torch.Tensor], cfg, optimizer_state: dict | None) -> list:
    """Diagonal P per parameter of ``params`` from an optimizer state (see the module doc),
    with the audit's lr / betas (``cfg``)."""
    from ..batchmask.precondition import preconditioner
    from .steps import optimizer_for

    opt = optimizer_for(params, cfg, optimizer_state)
    return [d.detach() if isinstance(d, torch.Tensor) else d
            for d in preconditioner(opt, params, [f"param{i}" for i in range(len(params))])]


def inner_products(model: torch.nn.Module, forward: Forward, rb, advantages: torch.Tensor, tokens: torch.Tensor,
                   cfg, *, P: list | None = None) -> dict[str, torch.Tensor]:
    """Per token of ``tokens`` (n, 2) = (b, t): ``s`` and its groups, and with ``P`` (a list
    from :func:`optimizer_preconditioner`) ``s^P`` and its groups.

    ``model`` is used as given (pass a float64 copy; its weights are not changed).
    Returns (n,) float64 tensors ``ip``, ``ip_<group>`` and, with P, ``pip``, ``pip_<group>``.
    Cost per token: two backward passes of its sequence (the forward is shared by the
    tokens of one sequence)."""
    params = trainable(model)
    roles = _Roles(model, params)
    n = tokens.shape[0]
    keys = ["ip", *(f"ip_{g}" for g in GROUPS)] + (["pip", *(f"pip_{g}" for g in GROUPS)] if P is not None else [])
    out = {k: torch.full((n,), float("nan"), dtype=F64) for k in keys}
    if n == 0:
        return out
    captured: list = []
    hook = None
    if roles.tied:
        hook = roles.emb_mod.register_forward_hook(lambda mod, args, res: captured.append((args[0], res)))
    try:
        for b in tokens[:, 0].unique().tolist():
            idx = (tokens[:, 0] == b).nonzero().squeeze(1).tolist()
            rows = slice(b, b + 1)
            captured.clear()
            logits = forward(model, rb.sequences[rows], rb.attention_mask[rows], rb.prompt_len)  # (1, T, V)
            wrt = list(params)
            if roles.tied:
                if len(captured) != 1:
                    raise ValueError("model: the input embedding was not called exactly once in the forward")
                look_ids, emb_out = captured[0]
                wrt.append(emb_out)
            for j, i in enumerate(idx):
                t = int(tokens[i, 1])
                last = j == len(idx) - 1
                D, logp = token_objectives(logits[0, t], rb, b, t, cfg.divergence, cfg.temperature)
                gD = torch.autograd.grad(D, wrt, allow_unused=True, retain_graph=True)
                L = advantages[b, t].to(logp.dtype) * logp
                gL = torch.autograd.grad(L, wrt, allow_unused=True, retain_graph=not last)
                gD = [torch.zeros_like(w) if g is None else g for w, g in zip(wrt, gD)]
                gL = [torch.zeros_like(w) if g is None else g for w, g in zip(wrt, gL)]
                eD = eL = None
                if roles.tied:
                    W = params[roles.shared[0]]
                    flat = look_ids.reshape(-1)

                    def scatter(g_out):
                        return torch.zeros_like(W).index_add_(0, flat, g_out.reshape(-1, W.shape[1]))
                    eD, eL = scatter(gD.pop()), scatter(gL.pop())
                for prefix, PP in (("ip", None), ("pip", P)):
                    if prefix == "pip" and P is None:
                        continue
                    parts = split(gD, gL, roles, emb_D=eD, emb_L=eL, P=PP)
                    for g in GROUPS:
                        out[f"{prefix}_{g}"][i] = parts[g]
                    out[prefix][i] = sum(parts.values())
    finally:
        if hook is not None:
            hook.remove()
    return out
