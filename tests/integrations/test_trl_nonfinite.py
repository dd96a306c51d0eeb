"""The TRL plugin stops at the first non-finite loss with a clear error naming the step
(issue 41): a diverging learning rate turns the weights non-finite at step 1's update; the
loss of step 2 (or, with the input check on, its logits) is refused there, naming step 2 and
``learning_rate``. Without it transformers logs the NaN loss as 0 and steps on."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="needs the trl extra: pip install -e '.[trl]' (run .ci/trl.sh)")
sys.path.insert(0, str(Path(__file__).parent))
import trl_helpers as H  # noqa: E402

from pdmask.integrations.trl import GRPOTrainer  # noqa: E402


@pytest.mark.parametrize("kw", [{}, {"mask_validate": False}, {"loss_from_hidden": True}],
                         ids=["checked-inputs", "unchecked-inputs", "from-hidden"])
def test_a_diverging_learning_rate_stops_at_the_step_it_shows(tmp_path, kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = H.make_trainer(tmp_path, cls=GRPOTrainer, learning_rate=1e308, max_steps=3, **kw)
        with pytest.raises(FloatingPointError) as e:
            t.train()
    msg = str(e.value)
    assert msg.startswith("step 2: ") and "non-finite" in msg and "learning_rate (now 1e+308)" in msg, msg
    assert "\n" not in msg
    assert t.state.global_step == 1  # the step that showed it was never taken


def test_a_finite_run_is_not_stopped(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = H.make_trainer(tmp_path, cls=GRPOTrainer, max_steps=2)
        t.train()
    assert t.state.global_step == 2
