"""params=: the subset variant equals the full computation restricted to those parameters."""

import pytest
import torch

from tests import flat  # noqa: E402

from pdmask_lab.batchmask import batch_mask, select_params
from pdmask.train.trainable import decoder_parts

from .helpers import TinyLM, make_batch, per_token_oracle, tiny_llama


def _last_block_params(model, blocks, head, norm):
    return list(blocks[-1].parameters()) + list(norm.parameters()) + list(head.parameters())


@pytest.mark.parametrize("method", ["jvp", "double-backward"])
def test_last_block_subset_equals_the_restricted_full_computation(method):
    m = TinyLM(seed=1, layers=3)
    batch = make_batch(m, seed=1)
    out = flat.batch_mask(m, **batch, params=1, method=method, all_tokens=True)
    sub = _last_block_params(m, *decoder_parts(m))
    ref, O, _, _ = per_token_oracle(m, batch, sub)
    full = flat.batch_mask(m, **batch, method=method, all_tokens=True)
    assert out.method == ("jvp-top" if method == "jvp" else method)  # forward mode replays the top block only
    assert O.any() and ref.abs().max() > 1e-3
    torch.testing.assert_close(out.ddot, ref, atol=1e-12, rtol=1e-10)
    assert not torch.allclose(out.ddot, full.ddot)  # the subset is a different (cheaper) criterion
    assert out.metrics["num_params"] == sum(p.numel() for p in sub)


def test_tied_head_in_the_subset_moves_the_output_projection_only():
    """Tied Llama, params=1: equals an untied copy (same weights) restricted to the last
    block, the final norm and lm_head — the input embedding stays fixed."""
    m = tiny_llama(tied=True, layers=3)
    batch = make_batch(m, seed=2)
    out = flat.batch_mask(m, **batch, params=1, all_tokens=True)
    assert out.method == "jvp-top"
    dbl = flat.batch_mask(m, **batch, params=1, method="double-backward", all_tokens=True)
    untied = tiny_llama(tied=False, layers=3)
    untied.load_state_dict(m.state_dict(), strict=False)
    with torch.no_grad():
        untied.lm_head.weight.copy_(m.model.embed_tokens.weight)
    sub = _last_block_params(untied, *decoder_parts(untied))
    ref, O, _, _ = per_token_oracle(untied, batch, sub)
    assert O.any() and ref.abs().max() > 1e-3
    torch.testing.assert_close(out.ddot, ref, atol=1e-6 * ref.abs().max().item(), rtol=1e-5)
    torch.testing.assert_close(dbl.ddot, out.ddot, atol=1e-9, rtol=1e-7)


class _ScaledLogits(TinyLM):
    """Something between the last block and the logits that the top replay does not know."""

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return 0.5 * super().forward(input_ids, attention_mask, position_ids)


def test_top_replay_that_does_not_reproduce_the_model_falls_back_to_the_whole_model_jvp():
    m = _ScaledLogits(seed=8, layers=3)
    batch = make_batch(m, seed=8)
    out = flat.batch_mask(m, **batch, params=1, method="jvp", all_tokens=True)
    assert out.method == "jvp"
    ref, O, _, _ = per_token_oracle(m, batch, _last_block_params(m, *decoder_parts(m)))
    assert O.any() and ref.abs().max() > 1e-3
    torch.testing.assert_close(out.ddot, ref, atol=1e-12, rtol=1e-10)


def test_a_list_of_names_selects_exactly_those():
    m = TinyLM(seed=3)
    batch = make_batch(m, seed=3)
    names = ["layers.0.up.weight", "lm_head.weight"]
    out = flat.batch_mask(m, **batch, params=names, all_tokens=True)
    by = dict(m.named_parameters())
    ref, _, _, _ = per_token_oracle(m, batch, [by[n] for n in names])
    torch.testing.assert_close(out.ddot, ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_blocks_head_and_norm_of_transformers_models(arch):
    m = tiny_llama(arch=arch, layers=3, tied=True)
    s = select_params(m, 2)
    names = sorted(n for ns in s.names for n in ns)
    assert all(n.startswith(("model.layers.1.", "model.layers.2.")) or n in ("model.norm.weight", "lm_head.weight")
               for n in names)
    assert "lm_head.weight" in names and "model.norm.weight" in names and "model.embed_tokens.weight" not in names
    assert any(n.startswith("model.layers.1.") for n in names) and not any(n.startswith("model.layers.0.") for n in names)
    # all: the tied matrix is one input used under both names
    a = select_params(m, "all")
    tied = [ns for ns in a.names if "lm_head.weight" in ns]
    assert tied == [["model.embed_tokens.weight", "lm_head.weight"]]


def test_the_subset_backward_never_reaches_the_lower_blocks():
    m = TinyLM(seed=4, layers=3)
    batch = make_batch(m, seed=4)
    calls = []
    h = m.layers[0].register_full_backward_hook(lambda *a: calls.append(1))
    try:
        flat.batch_mask(m, **batch, params=1, method="double-backward")
        assert calls == []
        flat.batch_mask(m, **batch, params="all", method="double-backward")
        assert calls
    finally:
        h.remove()


def test_frozen_parameters_are_never_differentiated():
    m = TinyLM(seed=5)
    for p in m.layers[0].parameters():
        p.requires_grad_(False)
    batch = make_batch(m, seed=5)
    out = flat.batch_mask(m, **batch, all_tokens=True)
    trainable = [p for p in m.parameters() if p.requires_grad]
    ref, _, _, _ = per_token_oracle(m, batch, trainable)
    torch.testing.assert_close(out.ddot, ref, atol=1e-12, rtol=1e-10)
    assert out.metrics["num_params"] == sum(p.numel() for p in trainable)


@pytest.mark.parametrize("params,msg", [
    (0, r"the number of last blocks must lie in \[1, 2\], got 0"),
    (3, r"the number of last blocks must lie in \[1, 2\], got 3"),
    ("last", "unknown value 'last'"),
    (["nope.weight"], "unknown parameter name 'nope.weight'"),
    (1.5, "expected 'all', an int or a list"),
])
def test_bad_params_are_refused_in_one_line(params, msg):
    m = TinyLM(seed=6)
    with pytest.raises(ValueError, match=f"^params: {msg}"):
        select_params(m, params)


def test_a_model_without_blocks_is_refused_for_the_subset_but_works_with_all():
    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(40, 8).double()
            self.out = torch.nn.Linear(8, 40).double()

        def forward(self, input_ids, attention_mask=None):
            return self.out(torch.tanh(self.emb(input_ids)))

    m = Flat()
    with pytest.raises(ValueError, match="^params: cannot find the decoder blocks of Flat"):
        select_params(m, 1)
    batch = make_batch(TinyLM(), seed=7)
    out = flat.batch_mask(m, **batch, all_tokens=True)
    ref, _, _, _ = per_token_oracle(m, batch, list(m.parameters()))
    torch.testing.assert_close(out.ddot, ref, atol=1e-12, rtol=1e-10)
