"""Session-wide fixtures shared by every test directory."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smoke_cache(tmp_path_factory):
    """The one SFT cache of the session: every run of the smoke preset (train, hardening,
    audit) trains its SFT base once and then reads it from here (the cache is
    content-addressed, so other settings add their own entry beside it)."""
    return tmp_path_factory.mktemp("sft-cache")


@pytest.fixture(scope="session")
def smoke_config():
    """configs/smoke.yaml, the tiny end-to-end preset."""
    return REPO / "configs" / "smoke.yaml"
