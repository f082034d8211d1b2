"""The documentation site builds: ``mkdocs build --strict`` passes (no missing page, link,
heading or API object), every page of docs/ is in the navigation, the math reaches the
browser as arithmatex blocks for KaTeX, and the API page shows the docstrings' examples as
code. Built once per run, offline, into a temporary folder."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CONFIG = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_nav_lists_every_page_once():
    pages = nav_pages(CONFIG["nav"])
    assert len(pages) == len(set(pages))
    assert set(pages) == {p.name for p in DOCS.glob("*.md")}


def page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text(encoding="utf-8")


def test_strict_build_writes_every_page(site):
    for name in nav_pages(CONFIG["nav"]):
        stem = Path(name).stem
        assert (site / ("index.html" if stem == "index" else f"{stem}/index.html")).exists()
    assert (site / "img" / "tiny_lm_attention.png").exists()


def test_math_is_mathml_at_build_time_with_the_equation_numbers(site):
    """No script renders the math when the page is read (nor fetches one): the built page
    holds MathML, each display with its number, and no LaTeX delimiter is left."""
    html = page(site, "derivation")
    tags = re.findall(r'<span class="math-tag">\(([^)]*)\)</span>', html)
    assert tags[:5] == ["1", "2", "3", "4", "5"]
    displays = re.findall(r"^\$\$\n.*?\n\$\$$", (DOCS / "derivation.md").read_text(
        encoding="utf-8"), flags=re.M | re.S)  # each display of the page, one piece's too
    assert html.count('<div class="math-display"><math') == len(displays) >= 29
    assert {"M1", "M2", "R0", "L1", "C1"} <= set(tags)
    assert '<math alttext="d_a" xmlns' in html  # inline math too, its LaTeX kept as alttext
    text = re.sub(r"<pre.*?</pre>|<code.*?</code>|alttext=\"[^\"]*\"", "", html, flags=re.S)
    assert "$$" not in text and r"\(" not in text and r"\[" not in text
    assert "katex" not in html.lower() and "cdn." not in html


@pytest.mark.parametrize("latex, why", [(r"x^", "MissingSuperScriptOrSubscriptError"),
                                         (r"\sqrt", "NoAvailableTokensError"),
                                         (r"a \foo b", r"unknown command \\foo")])
def test_a_formula_latex2mathml_cannot_convert_fails_the_build(latex, why):
    hook = load(ROOT / "tools" / "mkdocs_math.py")
    page = SimpleNamespace(file=SimpleNamespace(src_uri="derivation.md"))
    with pytest.raises(ValueError, match=rf"derivation.md: cannot render .*: {why}"):
        hook.on_page_content(f'<span class="arithmatex">\\({latex}\\)</span>', page, {}, None)


def test_api_page_shows_docstrings_with_examples_as_code(site):
    html = page(site, "api")
    for name in ["einattn.module.MultiHeadAttention", "einattn.functional.attention_scores",
                 "einattn.plot.attention", "einattn.masks"]:
        assert f'id="{name}"' in html, name
    assert "&gt;&gt;&gt;" in html  # the >>> prompts, inside code blocks
    assert not re.search(r"<blockquote>\s*<blockquote>", html)


def test_api_page_documents_every_public_module():
    package = ROOT / "einattn"
    modules = {p.stem for p in package.glob("*.py")} | {p.parent.name
                                                         for p in package.glob("*/__init__.py")}
    modules = {name for name in modules if not name.startswith("_")}
    documented = re.findall(r"^::: einattn\.(\w+)$", (DOCS / "api.md").read_text(encoding="utf-8"),
                            flags=re.M)
    assert len(documented) == len(set(documented))
    assert set(documented) == modules


# -- the build's helpers (tools/) ---------------------------------------------------------

def test_doctest_examples_become_fenced_code():
    markdown = load(ROOT / "tools" / "griffe_doctests.py").markdown
    docstring = ("Scores, see :func:`attention_scores`::\n\n"
                 "    S[n μ τ σ] = Q[n μ τ a] K[n μ σ a]\n\n"
                 ">>> f(2)\n4\n\n* A list item:\n\n    >>> g(\n    ...   3)\n    9\n\nMore text.")
    assert markdown(docstring) == ("Scores, see `attention_scores`:\n\n"
                                   "    S[n μ τ σ] = Q[n μ τ a] K[n μ σ a]\n\n"
                                   "```pycon\n>>> f(2)\n4\n```\n\n* A list item:\n\n"
                                   "```pycon\n>>> g(\n...   3)\n9\n```\n\nMore text.")
    assert markdown(markdown(docstring)) == markdown(docstring)  # fenced code is left alone


@pytest.mark.parametrize("repo_url, expected", [
    ("", "see report.py and [the layer](layer.md) and [gone](../no/such.py)."),
    ("https://example.org/einattn/",
     "see [report.py](https://example.org/einattn/blob/HEAD/einattn/bench/report.py#L1) and "
     "[the layer](layer.md) and [gone](../no/such.py)."),
])
def test_links_to_the_code_leave_the_docs_folder(repo_url, expected):
    hook = load(ROOT / "tools" / "mkdocs_hooks.py").on_page_markdown
    config = {"docs_dir": str(DOCS), "config_file_path": str(ROOT / "mkdocs.yml"),
              "repo_url": repo_url}
    page_ = SimpleNamespace(file=SimpleNamespace(src_uri="performance.md"))
    text = ("see [report.py](../einattn/bench/report.py#L1) and [the layer](layer.md) and "
            "[gone](../no/such.py).")
    assert hook(text, page_, config, None) == expected
    fenced = f"```md\n{text}\n```"
    assert hook(fenced, page_, config, None) == fenced
