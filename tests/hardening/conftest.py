import pytest

REPO_CONFIGS = __import__("pathlib").Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture
def cli_run():
    """Run the ``pdmask`` CLI in-process: ``cli_run(args) -> (exit_code, stdout+stderr, stderr)``."""
    pytest.importorskip("typer")
    from typer.testing import CliRunner

    from pdmask.cli import app

    def run(args):
        r = CliRunner().invoke(app, [str(a) for a in args])
        if r.exception is not None and not isinstance(r.exception, SystemExit):
            raise r.exception  # a traceback wall: the test fails with it
        return r.exit_code, r.output, r.stderr

    return run


@pytest.fixture(scope="session")
def smoke():
    return REPO_CONFIGS / "smoke.yaml"
