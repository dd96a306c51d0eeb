"""mkdocs hook of the documentation site (mkdocs.yml `hooks`): the docstrings are written with
Sphinx's cross-reference roles (``:class:`Rollout```, ``:func:``, ``:mod:`` ...) and its
``::`` before a literal block, which mkdocstrings renders as they are; on the site the role's
name is dropped (the name stays code) and ``::`` becomes ``:``."""

import re

ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|obj|exc|const|py:\w+):(?=<code>)")
LITERAL = re.compile(r"::(</p>)")


def on_page_content(html, **kwargs):
    return LITERAL.sub(r":\1", ROLE.sub("", html))
