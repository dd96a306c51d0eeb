"""No library call leaves torch's thread count changed (issue 41): ``pdmask.train.setup()``
called directly used to keep the config's ``threads`` (``train()`` restored it); now the
caller's count comes back, unless ``keep_threads=True`` (the lab's commands, whose work
follows at the config's count). The SFT warm start restores it too."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="run tests need the 'train' extra")

from pdmask.train.config import load_config  # noqa: E402
from pdmask.train.environment import torch_threads  # noqa: E402


@pytest.fixture
def caller_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield 3
    torch.set_num_threads(before)


def _cfg(smoke, cache, tmp_path, **over):
    return load_config(smoke, {"cache_dir": str(cache), "out_dir": str(tmp_path), "threads": 1, "progress": False,
                               **over})


def test_setup_gives_the_callers_thread_count_back(smoke, smoke_cache, tmp_path, caller_threads):
    import pdmask.train

    S = pdmask.train.setup(_cfg(smoke, smoke_cache, tmp_path))
    assert S.model is not None and torch.get_num_threads() == caller_threads
    pdmask.train.setup(_cfg(smoke, smoke_cache, tmp_path), keep_threads=True)
    assert torch.get_num_threads() == 1


def test_the_sft_warm_start_gives_it_back(smoke, tmp_path, caller_threads):
    from pdmask.train import ensure_sft_checkpoint

    ensure_sft_checkpoint(_cfg(smoke, tmp_path / "fresh-cache", tmp_path, sft_steps=2))  # trains: not cached
    assert torch.get_num_threads() == caller_threads


def test_torch_threads_restores_on_an_error_even_when_keeping(caller_threads):
    with torch_threads(2):
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == caller_threads
    with pytest.raises(RuntimeError), torch_threads(2, keep=True):
        raise RuntimeError("x")
    assert torch.get_num_threads() == caller_threads
    with torch_threads(2, keep=True):
        pass
    assert torch.get_num_threads() == 2
