"""Non-finite and inconsistent inputs to the core: each is refused with a ValueError whose
message starts with the argument's name (or, where the input is legitimate, gives the
finite, correct result)."""

import math

import pytest
import torch

import pdmask
from pdmask import _validate
from pdmask.loss import aggregate
from tests import flat  # noqa: E402

B, T, V, K = 2, 3, 10, 3


def good(seed=0):
    """Consistent inputs: mu's top-K, the sampled token its rank-1 entry (same log-prob)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    rl = torch.randn(B, T, V, generator=g)
    lp = torch.log_softmax(rl, -1)
    top = lp.topk(K, -1)
    return dict(logits=logits, sampled_ids=top.indices[..., 0], rollout_logprob=top.values[..., 0],
                rollout_topk_ids=top.indices, rollout_topk_logprobs=top.values,
                advantages=torch.randn(B, T, generator=g), response_mask=torch.ones(B, T, dtype=torch.bool),
                rollout_logits=rl)


def with_(name, pos, val, base=None):
    t = (base or good())[name].clone()
    t[pos] = val
    return t


def outside_topk():
    """Inputs whose sampled token is outside the top-K (its own mass joins the support)."""
    a = good()
    lp = torch.log_softmax(a["rollout_logits"], -1)
    order = lp.argsort(-1, descending=True)
    k = order[..., K]  # the (K+1)-th most likely token
    a["sampled_ids"] = k
    a["rollout_logprob"] = lp.gather(-1, k[..., None])[..., 0]
    return a


POLICY_ARGS = ("logits", "sampled_ids", "rollout_logprob", "rollout_topk_ids", "rollout_topk_logprobs",
               "advantages", "response_mask")


_MISSING = object()


def call(fn="policy_loss", base=None, **over):
    """Call ``fn`` on ``base`` (default :func:`good`) with ``over`` replacing inputs or adding
    keyword arguments. The rollout's full logits are passed for the ``pdm-full-*`` modes,
    when ``use_rl=True``, or when given in ``over``."""
    a = dict(base or good())
    rl = over.pop("rollout_logits", _MISSING)
    use_rl = over.pop("use_rl", False)
    kw = {k: over.pop(k) for k in list(over) if k not in a}
    a.update(over)
    own_rl = a.pop("rollout_logits")
    if rl is _MISSING:
        rl = own_rl if (use_rl or kw.get("mode", "").startswith("pdm-full")) else None
    if rl is not None:
        kw["rollout_logits"] = rl
    if fn == "policy_loss":
        return flat.policy_loss(*[a[k] for k in POLICY_ARGS], **kw)
    if fn == "trust_region_mask":
        return flat.trust_region_mask(*[a[k] for k in POLICY_ARGS], **kw)
    kw.pop("mode", None)
    return flat.token_stats(*[a[k] for k in POLICY_ARGS[:5]], response_mask=a["response_mask"], **kw)


def _mass_over_one():
    a = outside_topk()
    # top-K mass 0.9 (0.5, 0.3, 0.1) plus the sampled token's 0.2: 1.1 > 1
    a["rollout_topk_logprobs"] = torch.log(torch.tensor([0.5, 0.3, 0.1])).expand(B, T, K).clone()
    a["rollout_logprob"] = torch.full((B, T), math.log(0.2))
    return a


def _in_topk_mismatch(delta):
    a = good()
    a["rollout_logprob"] = a["rollout_logprob"] - delta
    return a


def _topk_entry_minus_inf():
    a = good()
    a["rollout_topk_logprobs"] = with_("rollout_topk_logprobs", (0, 1, 0), -math.inf)
    return a


def _rl(pos, val):
    a = good()
    a["rollout_logits"] = with_("rollout_logits", pos, val)
    return a


def _row(val):
    a = good()
    rl = a["rollout_logits"].clone()
    rl[1, 1] = val
    a["rollout_logits"] = rl
    return a


def _meta(name):
    t = good()[name]
    return {name: torch.empty(t.shape, dtype=t.dtype, device="meta")}


# (id, base inputs or None, overrides, argument named first in the message)
CASES = [
    # advantages: every non-finite value, both shapes
    ("adv +inf", None, dict(advantages=with_("advantages", (0, 1), math.inf)), "advantages"),
    ("adv -inf", None, dict(advantages=with_("advantages", (1, 2), -math.inf)), "advantages"),
    ("adv nan", None, dict(advantages=with_("advantages", (1, 0), math.nan)), "advantages"),
    ("adv (B,) +inf", None, dict(advantages=torch.tensor([1.0, math.inf])), "advantages"),
    ("adv (B,) -inf", None, dict(advantages=torch.tensor([-math.inf, 1.0])), "advantages"),
    ("adv (B,) nan", None, dict(advantages=torch.tensor([math.nan, 1.0])), "advantages"),
    ("adv int", None, dict(advantages=torch.ones(B, T, dtype=torch.long)), "advantages"),
    ("adv list", None, dict(advantages=[[1.0] * T] * B), "advantages"),
    # denominators
    ("loss_scale_factor 0", None, dict(loss_scale_factor=0, loss_agg="seq-mean-token-sum-norm"), "loss_scale_factor"),
    ("loss_scale_factor -4", None, dict(loss_scale_factor=-4.0, loss_agg="seq-mean-token-sum-norm"),
     "loss_scale_factor"),
    ("loss_scale_factor nan", None, dict(loss_scale_factor=math.nan, loss_agg="seq-mean-token-sum-norm"),
     "loss_scale_factor"),
    ("loss_scale_factor inf", None, dict(loss_scale_factor=math.inf, loss_agg="seq-mean-token-sum-norm"),
     "loss_scale_factor"),
    ("loss_scale_factor str", None, dict(loss_scale_factor="8", loss_agg="seq-mean-token-sum-norm"),
     "loss_scale_factor"),
    ("loss_scale_factor bool", None, dict(loss_scale_factor=True, loss_agg="seq-mean-token-sum-norm"),
     "loss_scale_factor"),
    ("loss_scale_factor t-2", None, dict(loss_scale_factor=torch.tensor(-2.0), loss_agg="seq-mean-token-sum-norm"),
     "loss_scale_factor"),
    ("loss_scale_factor t nan", None,
     dict(loss_scale_factor=torch.tensor(math.nan), loss_agg="seq-mean-token-sum-norm"), "loss_scale_factor"),
    ("num_tokens 0", None, dict(num_tokens=0), "num_tokens"),
    ("num_tokens -3", None, dict(num_tokens=-3), "num_tokens"),
    ("num_tokens nan", None, dict(num_tokens=math.nan), "num_tokens"),
    ("num_tokens inf", None, dict(num_tokens=math.inf), "num_tokens"),
    ("num_tokens t0", None, dict(num_tokens=torch.tensor(0)), "num_tokens"),
    ("num_tokens t nan", None, dict(num_tokens=torch.tensor(math.nan)), "num_tokens"),
    ("num_tokens t inf", None, dict(num_tokens=torch.tensor(math.inf)), "num_tokens"),
    ("num_tokens 2 values", None, dict(num_tokens=torch.tensor([3.0, 4.0])), "num_tokens"),
    ("num_tokens bool t", None, dict(num_tokens=torch.tensor(True)), "num_tokens"),
    ("num_seqs 0", None, dict(num_seqs=0, loss_agg="seq-mean-token-mean"), "num_seqs"),
    ("num_seqs -1", None, dict(num_seqs=-1, loss_agg="seq-mean-token-sum"), "num_seqs"),
    ("num_seqs nan", None, dict(num_seqs=math.nan, loss_agg="seq-mean-token-mean"), "num_seqs"),
    ("num_seqs t-1", None, dict(num_seqs=torch.tensor(-1), loss_agg="seq-mean-token-sum"), "num_seqs"),
    ("num_seqs None in list", None, dict(num_seqs=[2], loss_agg="seq-mean-token-mean"), "num_seqs"),
    # a denominator the mode does not read, and the data-parallel multiplier
    ("num_seqs unread", None, dict(num_seqs=4), "num_seqs"),
    ("num_tokens unread", None, dict(num_tokens=4, loss_agg="token-sum"), "num_tokens"),
    ("loss_scale_factor unread", None, dict(loss_scale_factor=8, loss_agg="seq-mean-token-sum"), "loss_scale_factor"),
    ("dp_size 0", None, dict(dp_size=0), "dp_size"),
    ("dp_size 2.0", None, dict(dp_size=2.0), "dp_size"),
    ("dp_size bool", None, dict(dp_size=True), "dp_size"),
    ("dp_size t2", None, dict(dp_size=torch.tensor(2)), "dp_size"),
    ("dp_size 2 local tokens", None, dict(dp_size=2), "num_tokens"),
    ("dp_size 2 local seqs", None, dict(dp_size=2, loss_agg="seq-mean-token-sum-norm", loss_scale_factor=8),
     "num_seqs"),
    # inconsistent top-K and sampled token
    ("sampled in top-K, lp off by 0.5", _in_topk_mismatch(0.5), {}, "rollout_logprob"),
    ("sampled in top-K, lp off by 0.05", _in_topk_mismatch(0.05), {}, "rollout_logprob"),
    ("sampled in top-K, entry -inf", _topk_entry_minus_inf(), {}, "rollout_logprob"),
    ("top-K + sampled mass > 1", _mass_over_one(), {}, "rollout_logprob"),
    ("top-K mass > 1", None, dict(rollout_topk_logprobs=torch.full((B, T, K), math.log(0.4))), "rollout_topk_logprobs"),
    # the rollout's full logits
    ("rollout_logits all nan", _rl((slice(None),), math.nan), dict(mode="pdm-full-kl"), "rollout_logits"),
    ("rollout_logits one nan", _rl((0, 2, 4), math.nan), dict(mode="pdm-full-kl"), "rollout_logits"),
    ("rollout_logits +inf", _rl((1, 0, 7), math.inf), dict(mode="pdm-full-tv"), "rollout_logits"),
    ("rollout_logits row -inf", _row(-math.inf), dict(mode="pdm-full-kl"), "rollout_logits"),
    ("rollout_logits row +inf", _row(math.inf), dict(mode="pdm-full-tv"), "rollout_logits"),
    ("rollout_logits nan, mode none", _rl((0, 0, 0), math.nan), dict(mode="none", use_rl=True),
     "rollout_logits"),
    ("rollout_logits int", None, dict(mode="pdm-full-kl", rollout_logits=torch.zeros(B, T, V, dtype=torch.long)),
     "rollout_logits"),
    ("rollout_logits shape", None, dict(mode="pdm-full-kl", rollout_logits=torch.zeros(B, T, V + 1)),
     "rollout_logits"),
    # logits of response rows
    ("logits nan", None, dict(logits=with_("logits", (0, 0, 3), math.nan)), "logits"),
    ("logits +inf", None, dict(logits=with_("logits", (1, 2, 0), math.inf)), "logits"),
    ("logits row nan", None, dict(logits=with_("logits", (1, 1), math.nan)), "logits"),
    # response_mask values
    ("mask 0.5", None, dict(response_mask=torch.full((B, T), 0.5)), "response_mask"),
    ("mask 2", None, dict(response_mask=torch.full((B, T), 2, dtype=torch.long)), "response_mask"),
    ("mask nan", None, dict(response_mask=with_("response_mask", (0, 0), math.nan,
                                                dict(good(), response_mask=torch.ones(B, T)))), "response_mask"),
    ("mask -1", None, dict(response_mask=-torch.ones(B, T, dtype=torch.long)), "response_mask"),
    ("mask complex", None, dict(response_mask=torch.ones(B, T, dtype=torch.complex64)), "response_mask"),
    ("mask list", None, dict(response_mask=[[1] * T] * B), "response_mask"),
    # tensors on another device than the logits
    *[(f"device {n}", None, _meta(n), n) for n in
      ("sampled_ids", "rollout_logprob", "rollout_topk_ids", "rollout_topk_logprobs", "advantages", "response_mask")],
    ("device rollout_logits", None, dict(mode="pdm-full-kl", **_meta("rollout_logits")), "rollout_logits"),
    # a mode's per-token extra (the batch mask's direction; the tests' flat ``batch_ddot``)
    ("device batch_ddot", None, dict(batch_ddot=torch.empty(B, T, device="meta")), "extras['ddot_batch']"),
    ("batch_ddot inf", None, dict(batch_ddot=with_("advantages", (0, 0), math.inf)), "extras['ddot_batch']"),
    ("batch_ddot nan", None, dict(batch_ddot=with_("advantages", (1, 1), math.nan)), "extras['ddot_batch']"),
    # scalar hyperparameters
    ("eps_low 1", None, dict(mode="grpo", eps_low=1.0), "eps_low"),
    ("eps_low 1.5", None, dict(mode="grpo", eps_low=1.5), "eps_low"),
    ("eps_low inf", None, dict(mode="grpo", eps_low=math.inf), "eps_low"),
    ("eps_high inf", None, dict(mode="grpo", eps_high=math.inf), "eps_high"),
    ("eps_high nan", None, dict(mode="grpo", eps_high=math.nan), "eps_high"),
    ("temperature bool", None, dict(temperature=True), "temperature"),
    ("temperature inf", None, dict(temperature=math.inf), "temperature"),
    ("temperature str", None, dict(temperature="1.0"), "temperature"),
    ("temperature -0.5", None, dict(temperature=-0.5), "temperature"),
    ("is_cap nan", None, dict(is_cap=math.nan), "is_cap"),
    ("is_cap -1", None, dict(is_cap=-1.0), "is_cap"),
    ("delta_low nan", None, dict(delta_low=math.nan), "delta_low"),
    ("delta_high str", None, dict(delta_high="0.1"), "delta_high"),
    ("delta_high bool", None, dict(delta_high=True), "delta_high"),
    ("chunk_size bool", None, dict(chunk_size=True), "chunk_rows"),
    ("chunk_size float", None, dict(chunk_size=64.0), "chunk_rows"),
]


#: the argument names of the flat spelling -> the names the errors give (fields of the Rollout)
NAMED = {"sampled_ids": "rollout.sampled_ids", "rollout_logprob": "rollout.sampled_logprob",
         "rollout_topk_ids": "rollout.topk_ids", "rollout_topk_logprobs": "rollout.topk_logprobs",
         "rollout_logits": "rollout.logits", "response_mask": "rollout.response_mask",
         "rollout_kept_mask": "rollout.kept_mask"}
CASES = [(c, b, o, NAMED.get(a, a)) for c, b, o, a in CASES]


@pytest.mark.parametrize("cid,base,over,arg", CASES, ids=[c[0] for c in CASES])
def test_policy_loss_refuses(cid, base, over, arg):
    with pytest.raises(ValueError) as e:
        call("policy_loss", base, **dict(over))
    assert str(e.value).startswith(arg + ":"), str(e.value)


# the subset that trust_region_mask and token_stats share (no aggregation, no advantages in token_stats)
SHARED = [c for c in CASES if c[3] not in ("loss_scale_factor", "num_tokens", "num_seqs", "dp_size", "is_cap")
          and not c[0].startswith("adv list")]


@pytest.mark.parametrize("cid,base,over,arg", SHARED, ids=[c[0] for c in SHARED])
def test_trust_region_mask_refuses(cid, base, over, arg):
    with pytest.raises(ValueError) as e:
        call("trust_region_mask", base, **dict(over))
    assert str(e.value).startswith(arg + ":"), str(e.value)


STATS = [c for c in SHARED if c[3] not in ("advantages", "extras['ddot_batch']", "eps_low", "eps_high", "delta_low",
                                           "delta_high")
         and "device batch" not in c[0]]


@pytest.mark.parametrize("cid,base,over,arg", STATS, ids=[c[0] for c in STATS])
def test_token_stats_refuses(cid, base, over, arg):
    with pytest.raises(ValueError) as e:
        call("token_stats", base, **dict(over))
    assert str(e.value).startswith(arg + ":"), str(e.value)


# ---------------------------------------------------------------- accepted: rounding, legit -inf
def test_sampled_lp_within_rounding_of_its_topk_entry_is_accepted():
    a = good()
    lp = a["rollout_logprob"]
    bf = lp.to(torch.bfloat16).float()  # the engine stored one of the two in bf16
    assert (bf != lp).any()
    out = call(base=dict(a, rollout_logprob=bf))
    assert torch.isfinite(out.loss)


def test_topk_plus_sampled_mass_within_rounding_is_accepted():
    a = outside_topk()
    lp = torch.log_softmax(a["rollout_logits"], -1)
    # the whole support S' = top-K + sampled with 4e-4 too much mass: rounding
    a["rollout_topk_logprobs"] = a["rollout_topk_logprobs"] + 4e-4
    assert ((a["rollout_topk_logprobs"].exp().sum(-1) + a["rollout_logprob"].exp()) <= 1 + 1e-3).all()
    out = call(base=a)
    assert torch.isfinite(out.loss)
    del lp


def test_rollout_logits_with_minus_inf_entries_are_accepted():
    """-inf rollout logits are tokens the engine truncated (mu = 0): legitimate."""
    a = good()
    rl = a["rollout_logits"].clone()
    lp = torch.log_softmax(rl, -1)
    worst = lp.argsort(-1)[..., :2]  # the two least likely tokens: never top-K or sampled here
    rl.scatter_(-1, worst, -math.inf)
    out = call(base=dict(a, rollout_logits=rl), mode="pdm-full-kl")
    assert torch.isfinite(out.loss) and torch.isfinite(out.stats["full_kl"]).all()


def test_bad_values_on_padding_only_are_accepted():
    a = good()
    m = torch.ones(B, T, dtype=torch.bool)
    m[1, 2] = False
    bad = dict(a, response_mask=m, advantages=with_("advantages", (1, 2), math.inf),
               rollout_logprob=with_("rollout_logprob", (1, 2), -4.0),  # inconsistent with its top-K entry
               rollout_logits=with_("rollout_logits", (1, 2), math.nan))
    out = call(base=bad, mode="pdm-full-kl", batch_ddot=with_("advantages", (1, 2), math.nan))
    assert torch.isfinite(out.loss)


def test_given_denominators_are_used_as_they_are():
    """num_tokens = 0.5 (a per-process share of a global count) is honoured, not clamped to 1."""
    a = good()
    ref = call(base=a, num_tokens=6.0).loss
    half = call(base=a, num_tokens=0.5).loss
    torch.testing.assert_close(half, ref * 12.0)
    t = call(base=a, num_tokens=torch.tensor(0.5)).loss
    torch.testing.assert_close(t, half)


# ---------------------------------------------------------------- aggregate on its own
AGG = [
    ("num_tokens", dict(num_tokens=0)), ("num_tokens", dict(num_tokens=-1.0)),
    ("num_tokens", dict(num_tokens=torch.tensor(-1.0))),
    ("num_seqs", dict(num_seqs=math.nan, loss_agg="seq-mean-token-sum")),
    ("num_seqs", dict(num_seqs=torch.tensor(math.inf), loss_agg="seq-mean-token-mean")),
    ("loss_scale_factor", dict(loss_scale_factor=0.0, loss_agg="seq-mean-token-sum-norm")),
    ("loss_scale_factor", dict(loss_scale_factor=torch.tensor(math.nan), loss_agg="seq-mean-token-sum-norm")),
    ("loss_agg", dict(loss_agg="mean")),
]


@pytest.mark.parametrize("arg,kw", AGG, ids=[f"{a}-{i}" for i, (a, _) in enumerate(AGG)])
def test_aggregate_refuses(arg, kw):
    with pytest.raises(ValueError) as e:
        aggregate(torch.randn(B, T), torch.ones(B, T, dtype=torch.bool), pdmask.Aggregation(**kw))
    assert str(e.value).startswith(arg + ":"), str(e.value)


# ---------------------------------------------------------------- host syncs
def test_validation_is_two_syncs_and_none_without_validate(monkeypatch):
    """All input checks are read back at once (before the logits are read); the finite-row
    check of the reductions is the second read-back. validate=False makes none."""
    runs = []
    orig = _validate.Checks.run

    def counting(self):
        runs.append(len(self.items))
        return orig(self)

    monkeypatch.setattr(_validate.Checks, "run", counting)
    call(mode="pdm-full-kl", num_tokens=torch.tensor(6.0), batch_ddot=torch.zeros(B, T))
    assert len(runs) == 2, runs
    assert runs[0] > 10  # every input check in the first
    runs.clear()
    call(mode="pdm-full-kl", num_tokens=torch.tensor(6.0), batch_ddot=torch.zeros(B, T), validate=False)
    assert runs == []


# ---------------------------------------------------------------- advantages too large for the loss dtype
HUGE = [("1e38", torch.full((B, T), 1e38)), ("-1e38", torch.full((B, T), -1e38)),
        ("mixed signs", torch.tensor([[1e38, -1e38, 1e38], [-1e38, 1e38, -1e38]])),
        ("(B,) 1e37", torch.tensor([1e37, -1e37])), ("float64 1e300", torch.full((B, T), 1e300, dtype=torch.float64))]


@pytest.mark.parametrize("mode", ["pdm-topk-kl", "grpo", "none", "dppo-binary-tv"])
@pytest.mark.parametrize("cid,adv", HUGE, ids=[h[0] for h in HUGE])
def test_advantages_that_would_overflow_the_loss_are_refused(cid, adv, mode):
    """|A| so large that |A| times the surrogate's capped ratio term is not a float32 number:
    refused up front (before the logits are read), never a silent inf/NaN loss."""
    with pytest.raises(ValueError, match=r"^advantages: .*float32.*overflow") as e:
        call(mode=mode, advantages=adv)
    assert "\n" not in str(e.value)


def test_advantages_below_the_bound_give_a_finite_loss_and_gradient():
    """The bound is a guarantee: just below it the loss (and here its gradient) is finite;
    in float64 the same 1e38 advantages are representable and accepted."""
    from pdmask.masks import advantage_limit

    for mode, surrogate in (("pdm-topk-kl", "dppo"), ("grpo", "ppo-clip")):
        limit = advantage_limit(surrogate, 5.0, torch.float32)
        adv = torch.full((B, T), 0.99 * limit / (B * T))
        logits = good()["logits"].clone().requires_grad_()
        out = call(mode=mode, logits=logits, advantages=adv)
        out.loss.backward()
        assert torch.isfinite(out.loss) and torch.isfinite(logits.grad).all(), mode
    a = good()
    out = call(logits=a["logits"].double(), advantages=torch.full((B, T), 1e38, dtype=torch.float64))
    assert torch.isfinite(out.loss)


def test_realistic_advantages_and_the_mask_alone_are_not_bounded():
    """Normalised advantages are far below the bound; trust_region_mask uses the sign of A
    only and takes any finite value."""
    assert torch.isfinite(call(advantages=torch.full((B, T), 1e6)).loss)
    m = call("trust_region_mask", advantages=torch.full((B, T), 1e38))
    assert m.dtype == torch.bool


# ---------------------------------------------------------------- the hidden-state path
H = 8


def hidden_call(hidden=None, weight=None, **kw):
    a = good()
    g = torch.Generator().manual_seed(3)
    h = torch.randn(B, T, H, generator=g) if hidden is None else hidden
    w = torch.randn(V, H, generator=g) if weight is None else weight
    return flat.policy_loss_from_hidden(h, w, *[a[k] for k in POLICY_ARGS[1:]], **kw)


def _with(shape, pos, val):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(4))
    t[pos] = val
    return t


@pytest.mark.parametrize("cid,kw,arg", [
    ("weight nan", dict(weight=_with((V, H), (3, 2), math.nan)), "lm_head_weight"),
    ("weight +inf", dict(weight=_with((V, H), (0, 0), math.inf)), "lm_head_weight"),
    ("weight -inf", dict(weight=_with((V, H), (9, 7), -math.inf)), "lm_head_weight"),
    ("hidden nan", dict(hidden=_with((B, T, H), (1, 2, 0), math.nan)), "hidden"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_hidden_path_names_the_non_finite_argument(cid, kw, arg):
    with pytest.raises(ValueError) as e:
        hidden_call(**kw)
    assert str(e.value).startswith(arg + ":"), str(e.value)


@pytest.mark.parametrize("mode", ["pdm-full-kl", "pdm-full-tv"])
def test_hidden_path_refuses_the_full_vocabulary_modes(mode):
    """policy_loss_from_hidden takes no rollout_logits: asking for them would name an
    argument it does not accept. The error says why and which modes work."""
    with pytest.raises(ValueError) as e:
        hidden_call(mode=mode)
    msg = str(e.value)
    assert msg.startswith(f"mode: {mode!r}"), msg
    assert "rollout_logits" in msg and "policy_loss_from_hidden" in msg and "pdm-topk-kl" in msg, msg
    assert "pdm-full-tv" not in msg.split("modes that work", 1)[-1], msg
