"""MkDocs hook: the pages' math becomes MathML when the site is built (mkdocs.yml names it).

pymdownx.arithmatex (generic mode) leaves ``$…$`` as ``\\(…\\)`` in ``span.arithmatex`` and
``$$…$$`` as ``\\[…\\]`` in ``div.arithmatex``. Here each one is converted by latex2mathml
(pure Python) into a ``<math>`` element, which every current browser renders with no script,
so the built site shows its formulas offline. A display's ``\\tag{…}`` becomes an equation
number at the right margin. A formula latex2mathml cannot convert, or a command it does not
know (which it would keep as text), fails the build, naming the page and the formula.
"""

from __future__ import annotations

import re
from html import escape, unescape

from latex2mathml.converter import convert

INLINE = re.compile(r'<span class="arithmatex">\\\((.*?)\\\)</span>', re.S)
DISPLAY = re.compile(r'<div class="arithmatex">\s*\\\[(.*?)\\\]\s*</div>', re.S)
TAG = re.compile(r"\\tag\{([^}]*)\}")


def mathml(latex: str, display: str, page) -> str:
    """One formula as a ``<math>`` element (``display`` "inline" or "block")."""
    try:
        element = convert(latex.strip(), display=display)
    except Exception as error:  # latex2mathml raises its own types and plain ones
        raise ValueError(f"{page.file.src_uri}: cannot render ${latex.strip()}$ as MathML: "
                         f"{type(error).__name__} {error}") from error
    if "\\" in element:  # a command latex2mathml does not know is kept as text: \foo
        command = re.search(r"\\\w+", element)
        raise ValueError(f"{page.file.src_uri}: cannot render ${latex.strip()}$ as MathML: "
                         f"unknown command {command.group(0) if command else '?'}")
    return element.replace("<math ", f'<math alttext="{escape(latex.strip())}" ', 1)


def on_page_content(html: str, page, config, files) -> str:
    def inline(m: re.Match) -> str:
        return f'<span class="math">{mathml(unescape(m.group(1)), "inline", page)}</span>'

    def display(m: re.Match) -> str:
        latex = unescape(m.group(1))
        tag = TAG.search(latex)
        number = f'<span class="math-tag">({escape(tag.group(1))})</span>' if tag else ""
        formula = mathml(TAG.sub("", latex), "block", page)
        return f'<div class="math-display">{formula}{number}</div>'

    return INLINE.sub(inline, DISPLAY.sub(display, html))
