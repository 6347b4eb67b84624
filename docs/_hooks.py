"""MkDocs hooks for the ferry site (``hooks:`` in mkdocs.yml; kept out of the site).

The docstrings are numpydoc and use Sphinx roles (``:class:`~ferry.DeviceArray```,
``:meth:`close```). Markdown has no roles, so the API reference would show them
literally; this hook turns each rendered role into a plain code span, as Sphinx
would show it: ``~`` keeps the last component, methods and functions get ``()``.
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:py:)?(class|meth|func|attr|data|exc|mod|obj):<code>(~?)([^<]+)</code>")


def _shown(match: re.Match[str]) -> str:
    role, short, target = match.groups()
    name = target.rsplit(".", 1)[-1] if short else target
    if role in ("meth", "func") and not name.endswith(")"):
        name += "()"
    return f"<code>{name}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    return ROLE.sub(_shown, html)
