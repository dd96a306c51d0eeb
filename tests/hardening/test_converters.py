"""Engine-format converters on malformed outputs: one ValueError that starts with the
argument and names the field and the position (sequence b, token t). Float token ids are
refused, never truncated; duplicate ids must carry the same log-prob."""

from __future__ import annotations

import base64
import math
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))
import engine_fakes as F  # noqa: E402

from pdmask.formats.sglang import from_sglang  # noqa: E402
from pdmask.formats.vllm import from_ranked_lists, from_vllm_logprobs, from_vllm_outputs  # noqa: E402

L = F.Logprob


def vllm_good():
    """Two sequences (3 and 2 tokens), k = 2, the sampled token in the top-K or not."""
    lp = [[{4: L(-0.1, 1), 7: L(-2.5, 2)}, {1: L(-0.3, 1), 2: L(-1.5, 2)}, {3: L(-4.0, 5), 5: L(-0.2, 1),
                                                                              6: L(-2.0, 2)}],
          [{0: L(-0.7, 1), 9: L(-0.9, 2)}, {8: L(-0.05, 1), 2: L(-3.5, 2)}]]
    ids = [[4, 2, 3], [9, 8]]
    return lp, ids


def flat_good():
    """FlatLogprobs of the same two sequences (sampled token first, then the top-2)."""
    seqs = []
    for d_list, sampled in zip(*vllm_good()):
        fl = F.FlatLogprobs()
        for d, s in zip(d_list, sampled):
            top = sorted(((tid, e) for tid, e in d.items()), key=lambda kv: kv[1].rank)[:2]
            ent = [(s, d[s])] + top
            fl.append_fast([t for t, _ in ent], [e.logprob for _, e in ent], [e.rank for _, e in ent],
                           [None] * len(ent))
        seqs.append(fl)
    return seqs, vllm_good()[1]


def vllm_case(mut):
    lp, ids = vllm_good()
    lp = [[dict(d) for d in s] for s in lp]
    ids = [list(s) for s in ids]
    lp, ids = mut(lp, ids) or (lp, ids)
    return lambda: from_vllm_logprobs(lp, ids, k=2)


def flat_case(mut):
    seqs, ids = flat_good()
    ids = [list(s) for s in ids]
    mut(seqs, ids)
    return lambda: from_vllm_logprobs(seqs, ids, k=2)


def _set(lst_fn, value):
    def mut(lp, ids):
        lst_fn(lp, ids, value)
    return mut


def _d(b, t, key, value):
    def mut(lp, ids):
        lp[b][t][key] = value
    return mut


def _repl_key(b, t, old, new):
    def mut(lp, ids):
        lp[b][t][new] = lp[b][t].pop(old)
    return mut


def _f(b, field, i, value):
    def mut(seqs, ids):
        getattr(seqs[b], field)[i] = value
    return mut


def _flen(b, field, delta):
    def mut(seqs, ids):
        lst = getattr(seqs[b], field)
        if delta < 0:
            del lst[delta:]
        else:
            lst.extend([lst[-1]] * delta)
    return mut


VLLM = [
    ("logprobs None", lambda: from_vllm_logprobs(None, [[1]], k=1), r"^logprobs: expected"),
    ("logprobs int", lambda: from_vllm_logprobs(5, [[1]], k=1), r"^logprobs: expected"),
    ("token_ids None", lambda: from_vllm_logprobs([[{1: L(-0.1, 1)}]], None, k=1), r"^token_ids: expected"),
    ("token id float", vllm_case(lambda lp, ids: ids[0].__setitem__(1, 2.0)),
     r"^token_ids: sequence 0, token 1: token id must be an int, got 2.0"),
    ("token id float not truncated", vllm_case(lambda lp, ids: ids[1].__setitem__(0, 9.7)),
     r"^token_ids: sequence 1, token 0: token id must be an int, got 9.7"),
    ("token id None", vllm_case(lambda lp, ids: ids[0].__setitem__(2, None)), r"^token_ids: sequence 0, token 2"),
    ("token id str", vllm_case(lambda lp, ids: ids[0].__setitem__(0, "4")), r"^token_ids: sequence 0, token 0"),
    ("token id bool", vllm_case(lambda lp, ids: ids[0].__setitem__(0, True)), r"^token_ids: sequence 0, token 0"),
    ("token id negative", vllm_case(lambda lp, ids: ids[1].__setitem__(1, -8)),
     r"^token_ids: sequence 1, token 1: token id must be >= 0"),
    ("token ids float tensor", vllm_case(lambda lp, ids: ids.__setitem__(1, torch.tensor([9.0, 8.0]))),
     r"^token_ids: sequence 1: expected a 1-D integer tensor"),
    ("sequence int", vllm_case(lambda lp, ids: lp.__setitem__(1, 5)), r"^logprobs: sequence 1: expected a list"),
    ("sequence dict", vllm_case(lambda lp, ids: lp.__setitem__(0, lp[0][0])), r"^logprobs: sequence 0: expected"),
    ("position None", vllm_case(lambda lp, ids: lp[0].__setitem__(1, None)),
     r"^logprobs: sequence 0, token 1 has no log-prob entries"),
    ("position empty", vllm_case(lambda lp, ids: lp[1].__setitem__(0, {})),
     r"^logprobs: sequence 1, token 0 has no log-prob entries"),
    ("position list", vllm_case(lambda lp, ids: lp[1].__setitem__(1, [(8, -0.05)])),
     r"^logprobs: sequence 1, token 1: expected a dict"),
    ("key float", vllm_case(_repl_key(0, 1, 1, 1.0)), r"^logprobs: sequence 0, token 1: token id must be an int"),
    ("key str", vllm_case(_repl_key(0, 0, 7, "7")), r"^logprobs: sequence 0, token 0: token id must be an int"),
    ("key None", vllm_case(_repl_key(1, 0, 0, None)), r"^logprobs: sequence 1, token 0: token id must be an int"),
    ("key negative", vllm_case(_repl_key(1, 1, 2, -2)), r"^logprobs: sequence 1, token 1: token id must be >= 0"),
    ("value None", vllm_case(_d(0, 2, 6, None)), r"^logprobs: sequence 0, token 2: the entry of token id 6"),
    ("value str", vllm_case(_d(0, 2, 6, "-2.0")), r"^logprobs: sequence 0, token 2: the entry of token id 6"),
    ("value bool", vllm_case(_d(1, 0, 9, True)), r"^logprobs: sequence 1, token 0: the entry of token id 9"),
    ("value tuple", vllm_case(_d(1, 0, 9, (-0.9, 2))), r"^logprobs: sequence 1, token 0: the entry of token id 9"),
    ("Logprob.logprob None", vllm_case(_d(0, 0, 7, L(None, 2))),
     r"^logprobs: sequence 0, token 0: Logprob.logprob of token id 7 must be a number, got None"),
    ("Logprob.logprob str", vllm_case(_d(0, 0, 7, L("-2.5", 2))),
     r"^logprobs: sequence 0, token 0: Logprob.logprob of token id 7 must be a number"),
    ("Logprob.rank float", vllm_case(_d(1, 1, 2, L(-3.5, 2.0))),
     r"^logprobs: sequence 1, token 1: rank must be an int or None"),
    ("Logprob.rank str", vllm_case(_d(1, 1, 2, L(-3.5, "2"))), r"^logprobs: sequence 1, token 1: rank"),
    ("Logprob nan", vllm_case(_d(1, 1, 2, L(math.nan, 2))), r"^logprobs: NaN log-prob at sequence 1, token 1"),
    ("Logprob positive", vllm_case(_d(0, 1, 2, L(2.0, 2))), r"^logprobs: positive log-prob .* sequence 0, token 1"),
    ("sampled missing", vllm_case(lambda lp, ids: ids[1].__setitem__(1, 5)),
     r"^logprobs: no entry for the sampled token id 5 at sequence 1, token 1"),
    ("length mismatch", vllm_case(lambda lp, ids: ids[0].append(4)), r"^logprobs: sequence 0 has 3 log-prob"),
    ("outputs not objects", lambda: from_vllm_outputs([{"x": 1}], k=1), r"^outputs: item 0: expected a vLLM"),
    ("outputs None", lambda: from_vllm_outputs(None, k=1), r"^outputs: expected"),
]

FLAT = [
    ("start float", flat_case(_f(0, "start_indices", 1, 3.0)),
     r"^logprobs: sequence 0, token 1: FlatLogprobs.start_indices\[1\] must be an int"),
    ("start None", flat_case(_f(1, "start_indices", 0, None)),
     r"^logprobs: sequence 1, token 0: FlatLogprobs.start_indices\[0\] must be an int"),
    ("start negative", flat_case(_f(0, "start_indices", 0, -1)),
     r"^logprobs: sequence 0, token 0: FlatLogprobs.start_indices\[0\] must be >= 0"),
    ("end before start", flat_case(_f(0, "end_indices", 1, 2)),
     r"^logprobs: sequence 0, token 1: FlatLogprobs range \[3, 2\)"),
    ("end beyond entries", flat_case(_f(1, "end_indices", 1, 99)),
     r"^logprobs: sequence 1, token 1: FlatLogprobs range \[3, 99\)"),
    ("end str", flat_case(_f(1, "end_indices", 1, "6")),
     r"^logprobs: sequence 1, token 1: FlatLogprobs.end_indices\[1\] must be an int"),
    ("fewer starts", flat_case(_flen(0, "start_indices", -1)), r"^logprobs: sequence 0: .*start_indices"),
    ("id float", flat_case(_f(0, "token_ids", 4, 1.0)),
     r"^logprobs: sequence 0, token 1: FlatLogprobs.token_ids\[4\] must be an int, got 1.0"),
    ("id float not truncated", flat_case(_f(1, "token_ids", 5, 2.9)),
     r"^logprobs: sequence 1, token 1: FlatLogprobs.token_ids\[5\] must be an int, got 2.9"),
    ("id None", flat_case(_f(1, "token_ids", 1, None)), r"^logprobs: sequence 1, token 0: FlatLogprobs.token_ids\[1\]"),
    ("id bool", flat_case(_f(0, "token_ids", 7, False)), r"^logprobs: sequence 0, token 2: FlatLogprobs.token_ids\[7\]"),
    ("id negative", flat_case(_f(0, "token_ids", 2, -3)),
     r"^logprobs: sequence 0, token 0: FlatLogprobs.token_ids\[2\] must be >= 0"),
    ("logprob None", flat_case(_f(0, "logprobs", 8, None)),
     r"^logprobs: sequence 0, token 2: FlatLogprobs.logprobs\[8\] must be a number, got None"),
    ("logprob str", flat_case(_f(1, "logprobs", 3, "x")), r"^logprobs: sequence 1, token 1: FlatLogprobs.logprobs\[3\]"),
    ("logprob list", flat_case(_f(1, "logprobs", 2, [-0.9])), r"^logprobs: sequence 1, token 0: FlatLogprobs.logprobs\[2\]"),
    ("rank float", flat_case(_f(0, "ranks", 0, 1.5)), r"^logprobs: sequence 0, token 0: FlatLogprobs.ranks\[0\]"),
    ("rank str", flat_case(_f(1, "ranks", 4, "1")), r"^logprobs: sequence 1, token 1: FlatLogprobs.ranks\[4\]"),
    ("ranks short", flat_case(_flen(0, "ranks", -2)), r"^logprobs: sequence 0: FlatLogprobs.ranks has 7 entries"),
    ("token_ids long", flat_case(_flen(1, "token_ids", 1)), r"^logprobs: sequence 1: FlatLogprobs.token_ids has 7"),
    ("sampled twice, different log-probs", flat_case(_f(0, "logprobs", 0, -0.6)),
     r"^logprobs: token id 4 appears twice at sequence 0, token 0 with different log-probs"),
    ("id float tensor", flat_case(lambda s, i: setattr(s[0], "token_ids", torch.tensor(s[0].token_ids, dtype=torch.float32))),
     r"^logprobs: FlatLogprobs.token_ids must hold ints"),
]


def ranked_good():
    lps = [[[-0.1, -2.5], [-0.3, -1.5, -2.2]], [[-0.7, -0.9]]]
    lids = [[[4, 7], [1, 2, 3]], [[0, 9]]]
    ids = [[4, 3], [9]]
    return lps, lids, ids


def ranked_case(mut):
    lps, lids, ids = ranked_good()
    mut(lps, lids, ids)
    return lambda: from_ranked_lists(lps, lids, ids, k=2)


RANKED = [
    ("logprobs None", lambda: from_ranked_lists(None, [[[1]]], [[1]], k=1), r"^logprobs: expected"),
    ("logprob_token_ids int", lambda: from_ranked_lists([[[-0.1]]], 3, [[1]], k=1), r"^logprob_token_ids: expected"),
    ("sequence int", ranked_case(lambda a, b, c: a.__setitem__(1, 7)), r"^logprobs: sequence 1: expected"),
    ("row None", ranked_case(lambda a, b, c: a[0].__setitem__(1, None)), r"^logprobs: sequence 0, token 1: expected"),
    ("row of ids str", ranked_case(lambda a, b, c: b[1].__setitem__(0, "09")),
     r"^logprob_token_ids: sequence 1, token 0: expected a list of token ids"),
    ("None log-prob", ranked_case(lambda a, b, c: a[0][1].__setitem__(2, None)),
     r"^logprobs: sequence 0, token 1: a log-prob is None"),
    ("str log-prob", ranked_case(lambda a, b, c: a[1][0].__setitem__(1, "-0.9")),
     r"^logprobs: sequence 1, token 0: log-prob must be a number"),
    ("id float", ranked_case(lambda a, b, c: b[0][0].__setitem__(1, 7.0)),
     r"^logprob_token_ids: sequence 0, token 0: token id must be an int, got 7.0"),
    ("id None", ranked_case(lambda a, b, c: b[0][1].__setitem__(0, None)),
     r"^logprob_token_ids: sequence 0, token 1: token id must be an int"),
    ("id negative", ranked_case(lambda a, b, c: b[1][0].__setitem__(0, -1)),
     r"^logprob_token_ids: sequence 1, token 0: token id must be >= 0"),
    ("duplicate, different log-probs", ranked_case(lambda a, b, c: b[0][1].__setitem__(2, 1)),
     r"^logprobs: token id 1 appears twice at sequence 0, token 1 with different log-probs"),
    ("row lengths", ranked_case(lambda a, b, c: b[0][1].pop()), r"^logprob_token_ids: sequence 0, token 1 has 2 ids"),
    ("sampled float", ranked_case(lambda a, b, c: c[0].__setitem__(1, 3.0)),
     r"^token_ids: sequence 0, token 1: token id must be an int"),
    ("sampled not reported", ranked_case(lambda a, b, c: c[1].__setitem__(0, 5)),
     r"^logprobs: no entry for the sampled token id 5 at sequence 1, token 0"),
]


def sg_good():
    return [{"output_ids": [3, 6], "meta_info": {
        "output_token_logprobs": [[-0.2, 3, None], [-1.9, 6, None]],
        "output_top_logprobs": [[[-0.2, 3, None], [-2.0, 5, None]], [[-0.4, 1, None], [-1.5, 2, None]]]}}]


def sg_case(mut, **kw):
    res = sg_good()
    mut(res[0]["meta_info"])
    return lambda: from_sglang(res, k=2, **kw)


def _flat_meta(vals=None, idx=None, b64=True, shape=(2, 2), null=0):
    v = vals if vals is not None else [-0.2, -2.0, -0.4, -1.5]
    i = idx if idx is not None else [3, 5, 1, 2]
    m = {"output_token_logprobs": [[-0.2, 3, None], [-1.9, 6, None]], "output_top_logprobs_shape": list(shape),
         "output_top_logprobs_null_prefix": null}
    if b64:
        m["output_top_logprobs_val_flat_b64"] = base64.b64encode(torch.tensor(v, dtype=torch.float32).numpy().tobytes()).decode()
        m["output_top_logprobs_idx_flat_b64"] = base64.b64encode(torch.tensor(i, dtype=torch.int32).numpy().tobytes()).decode()
    else:
        m["output_top_logprobs_val_flat"], m["output_top_logprobs_idx_flat"] = v, i
    return m


def sg_flat(edit, b64=True):
    m = _flat_meta(b64=b64)
    edit(m)
    return lambda: from_sglang([m], k=2)


def _set_key(k, v):
    return lambda m: m.__setitem__(k, v)


SGLANG = [
    ("results None", lambda: from_sglang(None, k=1), r"^results: expected"),
    ("item list", lambda: from_sglang([[1, 2]], k=1), r"^results: sequence 0: expected an SGLang result dict"),
    ("meta_info str", lambda: from_sglang([{"meta_info": "x"}], k=1), r"^results: sequence 0: 'meta_info' must be"),
    ("token logprobs int", sg_case(_set_key("output_token_logprobs", 5)), r"^results: sequence 0: expected"),
    ("entry short", sg_case(lambda m: m["output_token_logprobs"].__setitem__(1, [-1.9])),
     r"^results: sequence 0, token 1: output_token_logprobs must be a \(logprob, token_id, text\) triple"),
    ("entry None", sg_case(lambda m: m["output_token_logprobs"].__setitem__(0, None)),
     r"^results: sequence 0, token 0: output_token_logprobs must be"),
    ("entry id float", sg_case(lambda m: m["output_token_logprobs"][1].__setitem__(1, 6.0)),
     r"^results: sequence 0, token 1: output_token_logprobs's token id must be an int, got 6.0"),
    ("entry id None", sg_case(lambda m: m["output_token_logprobs"][0].__setitem__(1, None)),
     r"^results: sequence 0, token 0: output_token_logprobs's token id"),
    ("entry lp str", sg_case(lambda m: m["output_token_logprobs"][0].__setitem__(0, "-0.2")),
     r"^results: sequence 0, token 0: output_token_logprobs's log-prob must be a number"),
    ("entry lp null", sg_case(lambda m: m["output_token_logprobs"][1].__setitem__(0, None)),
     r"^results: sequence 0, token 1: the sampled token's log-prob is null"),
    ("top row int", sg_case(lambda m: m["output_top_logprobs"].__setitem__(1, 7)),
     r"^results: sequence 0, token 1: expected output_top_logprobs row"),
    ("top entry id float", sg_case(lambda m: m["output_top_logprobs"][1][1].__setitem__(1, 2.5)),
     r"^results: sequence 0, token 1: output_top_logprobs entry 1's token id must be an int, got 2.5"),
    ("top entry id None", sg_case(lambda m: m["output_top_logprobs"][0][1].__setitem__(1, None)),
     r"^results: sequence 0, token 0: output_top_logprobs entry 1's token id"),
    ("top entry lp str", sg_case(lambda m: m["output_top_logprobs"][0][1].__setitem__(0, "x")),
     r"^results: sequence 0, token 0: output_top_logprobs entry 1's log-prob"),
    ("top entry scalar", sg_case(lambda m: m["output_top_logprobs"][1].__setitem__(0, -0.4)),
     r"^results: sequence 0, token 1: output_top_logprobs entry 0 must be"),
    ("sampled differs from its top entry", sg_case(lambda m: m["output_token_logprobs"][0].__setitem__(0, -0.9)),
     r"^results: token id 3 appears twice at sequence 0, token 0 with different log-probs"),
    ("top rows short", sg_case(lambda m: m["output_top_logprobs"].pop()), r"^results: sequence 0: 1 top-log-prob rows"),
    # a duplicate whose kept entry is -inf (a null log-prob): the tolerance must not become inf
    ("duplicate after a -inf entry", sg_case(lambda m: m["output_top_logprobs"].__setitem__(
        0, [[-0.2, 3, None], [None, 5, None], [-1.45, 5, None]])),
     r"^results: token id 5 appears twice at sequence 0, token 0 with different log-probs \(-inf and -1\.45\)"),
    ("sampled finite, its top entry null", sg_case(lambda m: (
        m["output_token_logprobs"].__setitem__(0, [-1.45, 5, None]),
        m["output_top_logprobs"].__setitem__(0, [[-0.2, 3, None], [None, 5, None]])), output_ids=[[5, 6]]),
     r"^results: token id 5 appears twice at sequence 0, token 0 with different log-probs \(-inf and -1\.45\)"),
    ("output_ids float", lambda: from_sglang(sg_good(), k=2, output_ids=[[3, 6.0]]),
     r"^output_ids: sequence 0, token 1: token id must be an int"),
    ("output_ids None", lambda: from_sglang(sg_good(), k=2, output_ids=[[None, 6]]),
     r"^output_ids: sequence 0, token 0"),
    ("output_ids mismatch", lambda: from_sglang(sg_good(), k=2, output_ids=[[3, 7]]),
     r"^output_ids: sequence 0 does not match"),
    ("flat shape str", sg_flat(_set_key("output_top_logprobs_shape", "2x2")),
     r"^results: sequence 0: meta_info\['output_top_logprobs_shape'\] must be"),
    ("flat shape float", sg_flat(_set_key("output_top_logprobs_shape", [2.0, 2])),
     r"^results: sequence 0: meta_info\['output_top_logprobs_shape'\]"),
    ("flat null prefix negative", sg_flat(_set_key("output_top_logprobs_null_prefix", -1)),
     r"^results: sequence 0: meta_info\['output_top_logprobs_null_prefix'\]"),
    ("flat b64 truncated", sg_flat(lambda m: m.__setitem__("output_top_logprobs_val_flat_b64",
                                                           m["output_top_logprobs_val_flat_b64"][:-3])),
     r"^results: sequence 0: meta_info\['output_top_logprobs_val_flat_b64'\] is not valid base64"),
    ("flat b64 odd bytes", sg_flat(lambda m: m.__setitem__("output_top_logprobs_idx_flat_b64",
                                                           base64.b64encode(b"\x01\x02\x03\x04\x05\x06").decode())),
     r"^results: sequence 0: meta_info\['output_top_logprobs_idx_flat_b64'\] decodes to 6 bytes"),
    ("flat b64 garbage", sg_flat(_set_key("output_top_logprobs_val_flat_b64", "@@@@")),
     r"^results: sequence 0: meta_info\['output_top_logprobs_val_flat_b64'\] is not valid base64"),
    ("flat b64 list", sg_flat(_set_key("output_top_logprobs_idx_flat_b64", [1, 2])),
     r"^results: sequence 0: meta_info\['output_top_logprobs_idx_flat_b64'\] must be a base64 string"),
    ("flat b64 idx missing", sg_flat(lambda m: m.pop("output_top_logprobs_idx_flat_b64")),
     r"^results: sequence 0: .*no output_top_logprobs_idx_flat_b64"),
    ("flat list idx float", sg_flat(lambda m: m["output_top_logprobs_idx_flat"].__setitem__(3, 2.5), b64=False),
     r"^results: sequence 0, token 1: output_top_logprobs entry 1's token id must be an int, got 2.5"),
    ("flat list val str", sg_flat(lambda m: m["output_top_logprobs_val_flat"].__setitem__(0, "x"), b64=False),
     r"^results: sequence 0, token 0: output_top_logprobs entry 0's log-prob"),
    ("flat list missing", sg_flat(lambda m: m.pop("output_top_logprobs_val_flat"), b64=False),
     r"^results: sequence 0: meta_info has output_top_logprobs_shape but no output_top_logprobs_val_flat"),
    ("flat rows mismatch", sg_flat(_set_key("output_top_logprobs_shape", [1, 4])),
     r"^results: sequence 0: flat top log-probs cover 1 positions"),
]

# sampling settings given as strings (a YAML or CLI value not converted): one line naming the key
def _setting(name, value):
    kind = "an int" if name == "top_k" else "a number"
    return (f"{name} {value!r}", lambda: from_sglang(sg_good(), k=2, **{name: value}),
            rf"^{name}: must be {kind} or None, got {re.escape(repr(value))}")


def _vllm_setting(name, value, mode):
    kind = "an int" if name == "top_k" else "a number"
    return (f"vllm {mode} {name} {value!r}", lambda: from_vllm_logprobs(*vllm_good(), k=2, logprobs_mode=mode,
                                                                         **{name: value}),
            rf"^{name}: must be {kind} or None, got {re.escape(repr(value))}")


SETTINGS = [_vllm_setting(n, v, m) for m in ("raw_logprobs", "processed_logprobs")
            for n, v in (("temperature", "0.7"), ("top_k", "20"), ("top_p", "x"), ("min_p", "0"))]
SETTINGS += [_setting(n, v) for n, v in (("temperature", "0.7"), ("top_p", "0.9"), ("top_k", "20"), ("min_p", "0.1"),
                                        ("temperature", "hot"), ("top_k", 2.5), ("top_p", True),
                                        ("min_p", float("nan")))]

ALL = [("vllm", *c) for c in VLLM] + [("flat", *c) for c in FLAT] + [("ranked", *c) for c in RANKED] \
    + [("sglang", *c) for c in SGLANG] + [("sglang-settings", *c) for c in SETTINGS]


@pytest.mark.parametrize("kind,cid,fn,pattern", ALL, ids=[f"{c[0]}-{c[1]}" for c in ALL])
def test_converter_refuses_with_field_and_position(kind, cid, fn, pattern):
    with pytest.raises(ValueError) as e:
        fn()
    assert re.search(pattern, str(e.value)), str(e.value)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- the good inputs pass
def test_good_inputs_convert_and_agree():
    lp, ids = vllm_good()
    a = from_vllm_logprobs(lp, ids, k=2)
    seqs, ids2 = flat_good()
    b = from_vllm_logprobs(seqs, ids2, k=2)
    for x, y in ((a.topk_ids, b.topk_ids), (a.topk_logprobs, b.topk_logprobs), (a.sampled_logprob, b.sampled_logprob)):
        assert torch.equal(x, y)
    assert a.sampled_logprob[0].tolist() == pytest.approx([-0.1, -1.5, -4.0])
    r = from_ranked_lists(*ranked_good(), k=2)
    assert r.topk_ids[0, 1].tolist() == [1, 2] and r.sampled_logprob[0, 1].item() == pytest.approx(-2.2)
    s = from_sglang(sg_good(), k=2)
    f = from_sglang([_flat_meta()], k=2)
    assert torch.equal(s.topk_ids, f.topk_ids) and torch.equal(s.topk_logprobs, f.topk_logprobs)


def test_numpy_ints_and_int_tensors_are_token_ids():
    np = pytest.importorskip("numpy")
    lp, ids = vllm_good()
    a = from_vllm_logprobs(lp, [np.array(ids[0]), torch.tensor(ids[1])], k=2)
    assert a.sampled_ids[0, :3].tolist() == ids[0]


def test_duplicates_with_the_same_log_prob_are_merged():
    """Same id twice with the same log-prob (FlatLogprobs' sampled-token copy, or a ranked
    list that repeats an entry): one entry is kept (the smaller rank), its value used."""
    lps, lids, ids = ranked_good()
    lids[0][1][2] = 1
    lps[0][1][2] = -0.3  # the same as the first entry of id 1
    ids[0][1] = 1
    r = from_ranked_lists(lps, lids, ids, k=2)
    assert r.topk_ids[0, 1].tolist() == [1, 2]
    assert r.sampled_logprob[0, 1].item() == pytest.approx(-0.3)
    # within rounding (a bf16 copy of one of the two)
    lps[0][1][2] = float(torch.tensor(-0.3).bfloat16())
    assert from_ranked_lists(lps, lids, ids, k=2).sampled_logprob[0, 1].item() == pytest.approx(-0.3)
