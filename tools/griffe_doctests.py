"""A griffe extension for the API page: einattn's docstrings as Markdown.

einattn's docstrings are plain text with ``code``, reST roles such as :func:`main`, and
``>>>`` examples that pytest runs as doctests. Markdown would read a ``>>>`` line as three
nested block quotes; this extension fences each example (its ``>>>`` and ``...`` lines and
the output after them, up to a blank line) as a ``pycon`` code block at the left margin
(indented, Markdown could take it for a code block or for more of a list item), writes a
role as plain code, and turns reST's ``::`` before a literal block into ``:``.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:mod|class|func|meth|attr|data|exc|obj):`~?([^`]+)`")


def markdown(docstring: str) -> str:
    out: list[str] = []
    lines = docstring.splitlines()
    k, fenced = 0, False
    while k < len(lines):
        line = lines[k]
        stripped = line.lstrip()
        if stripped.startswith("```"):
            fenced = not fenced
        elif not fenced and (stripped == ">>>" or stripped.startswith(">>> ")):
            indent = len(line) - len(stripped)  # in a list item, say: the fence ends it
            out.append("```pycon")
            while k < len(lines) and lines[k].strip():
                out.append(lines[k][indent:])
                k += 1
            out.append("```")
            continue
        elif not fenced:
            line = ROLE.sub(r"`\1`", line)
            if line.endswith("::") and not line.endswith(" ::"):
                line = line[:-1]
            elif line.strip() == "::":
                line = ""
        out.append(line)
        k += 1
    return "\n".join(out)


class DoctestsAsMarkdown(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and not obj.is_alias:
            obj.docstring.value = markdown(obj.docstring.value)
