"""The documentation site (mkdocs.yml) stays complete: every page is in its nav, the API
reference names every public name and entry point, every relative link of the pages points
at something, and CI builds it with ``--strict`` in its own pinned environment.

The build itself (``mkdocs build --strict``: missing pages, anchors and API names) runs in
.ci/docs.sh; these checks need no mkdocs and run in the main suite.
"""

import ast
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")
DIRECTIVE = re.compile(r"^::: ([\w.]+)\s*$", re.M)


class _Loader(yaml.SafeLoader):
    """mkdocs.yml with its ``!!python/...`` tags (the toc's slugify) read as null."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def _mkdocs() -> dict:
    return yaml.load((REPO / "mkdocs.yml").read_text(), Loader=_Loader)


def _nav_pages(nav) -> list[str]:
    out = []
    for item in nav:
        for v in (item.values() if isinstance(item, dict) else [item]):
            out += _nav_pages(v) if isinstance(v, list) else [v]
    return out


def _all_of(module_file: Path) -> list[str]:
    """``__all__`` of a module, read from its source (the TRL and verl plugins' modules import
    packages the main environment lacks)."""
    for node in ast.parse(module_file.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{module_file} has no __all__")


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    pages = _nav_pages(_mkdocs()["nav"])
    assert len(pages) == len(set(pages))
    missing = [p for p in pages if not (DOCS / p).is_file()]
    assert not missing, f"mkdocs.yml nav names pages that do not exist: {missing}"
    top = {p.relative_to(DOCS).as_posix() for p in [*DOCS.glob("*.md"), *(DOCS / "api").glob("*.md")]}
    assert not top - set(pages), f"pages not in mkdocs.yml's nav: {sorted(top - set(pages))}"
    assert "results/README.md" in pages


def test_the_api_reference_names_every_public_name():
    import pdmask

    names = DIRECTIVE.findall((DOCS / "api" / "index.md").read_text())
    assert len(names) == len(set(names))
    documented = {n.removeprefix("pdmask.") for n in names}
    assert documented == set(pdmask.__all__), (f"pdmask.__all__ without an API entry: "
                                               f"{sorted(set(pdmask.__all__) - documented)}; "
                                               f"entries not in __all__: {sorted(documented - set(pdmask.__all__))}")


@pytest.mark.parametrize("page,package", [("trl.md", "trl"), ("verl.md", "verl")])
def test_the_plugins_api_pages_name_every_public_name(page, package):
    want = set(_all_of(REPO / "src" / "pdmask" / "integrations" / package / "__init__.py"))
    names = DIRECTIVE.findall((DOCS / "api" / page).read_text())
    prefix = f"pdmask.integrations.{package}."
    documented = {n.removeprefix(prefix) for n in names if n.startswith(prefix)}
    assert want <= documented, f"{package}: no API entry for {sorted(want - documented)}"


def test_the_entry_points_are_documented():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs python >= 3.11")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    targets = [*project["scripts"].values()]
    for group in project["entry-points"].values():
        targets += group.values()
    api = "".join(p.read_text() for p in (DOCS / "api").glob("*.md"))
    documented = set(DIRECTIVE.findall(api))
    for t in targets:
        assert t.replace(":", ".") in documented, f"entry point {t} has no API entry"


def test_every_relative_link_of_the_pages_exists():
    """Links to files and folders (a folder is not a page of the site, so the strict build
    does not check it; on the repository it is a listing) and to README snippets."""
    bad = []
    for page in DOCS.rglob("*.md"):
        text = page.read_text()
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            if path and not (page.parent / path).exists():
                bad.append(f"{page.relative_to(DOCS)}: {target}")
    assert not bad, f"broken links: {bad[:10]}"


def test_the_home_page_snippets_are_sections_of_the_readme():
    readme = (REPO / "README.md").read_text()
    used = re.findall(r'--8<-- "README\.md:([\w-]+)"', (DOCS / "index.md").read_text())
    assert used
    for name in used:
        assert f"--8<-- [start:{name}]" in readme and f"--8<-- [end:{name}]" in readme, name
    # the home page shows the README's set-up line and its quickstart code, not copies of them
    from tests.test_constraints import COMMAND

    def section(name):
        return readme.split(f"--8<-- [start:{name}] -->")[1].split(f"<!-- --8<-- [end:{name}]")[0]

    assert COMMAND in section("setup")
    quick = section("quickstart")
    assert quick.strip().startswith("```python") and "pdmask.policy_loss(" in quick


def test_ci_builds_the_site_strictly_in_its_own_pinned_environment():
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"for extra in [^;]*\bdocs\b", ci), ".ci/run does not run .ci/docs.sh"
    script = (REPO / ".ci" / "docs.sh").read_text()
    assert "-r constraints/docs.txt" in script and "mkdocs\" build --strict" in script
    assert _mkdocs()["strict"] is True
    pins = {}
    for line in (REPO / "constraints" / "docs.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints/docs.txt: not an exact pin: {line!r}"
            pins[name.lower().replace("_", "-")] = version
    for pkg in ("mkdocs", "mkdocs-material", "mkdocstrings", "mkdocstrings-python", "griffelib", "pymdown-extensions"):
        assert pkg in pins, f"constraints/docs.txt does not pin {pkg}"
    assert "torch" not in pins and "pdmask" not in pins
    assert "site/" in (REPO / ".gitignore").read_text().splitlines()
    # the README's one command that builds it locally is the one the constraints file names
    line = next(ln.strip("# ").strip() for ln in (REPO / "constraints" / "docs.txt").read_text().splitlines()
                if "mkdocs build" in ln)
    assert f"\n{line}\n" in (REPO / "README.md").read_text()
