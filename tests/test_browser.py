"""The math pages as a reader sees them: the built site, served on loopback, opened in
headless Chromium with every other host unreachable (no network, as on an offline laptop).

Every formula of the Markdown source (counted here from the source, independently of the
build) must be a ``<math>`` element in the page the browser holds, and no LaTeX delimiter
may be left in its text; a screenshot of each page goes to the test's temporary folder.
Skipped, saying why, where Chromium is not installed (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import functools
import html
import json
import re
import shutil
import subprocess
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium to open the site in: "
                                                        "apt-get install chromium")
PAGES = ["derivation", "linear", "notation", "layouts"]  # every page with math
OFFLINE = "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"  # loopback alone


def math_in_source(page: str) -> tuple[int, int]:
    """The numbers of ``$$…$$`` displays and of ``$…$`` inline formulas of a page, code
    left out."""
    md = (DOCS / f"{page}.md").read_text(encoding="utf-8")
    md = re.sub(r"^```.*?^```", "", md, flags=re.S | re.M)
    md = re.sub(r"`[^`\n]*`", "", md)
    display = re.compile(r"^\$\$\n.*?\n\$\$$", re.S | re.M)
    inline = re.findall(r"(?<![\\$])\$(?!\s)[^$\n]+?(?<!\s)\$", display.sub("", md))
    return len(display.findall(md)), len(inline)


def formulas_in_source(page: str) -> int:
    """``$$…$$`` displays and ``$…$`` inline formulas of a page, code left out."""
    return sum(math_in_source(page))


@pytest.fixture(scope="module")
def served(site):
    """The built site on a loopback port, for the module's tests."""
    handler = functools.partial(_Quiet, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no request log on the test's stderr
        pass


def chromium(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
                           OFFLINE, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", PAGES)
def test_every_formula_renders_offline(served, name, tmp_path):
    dom = chromium("--dump-dom", f"{served}/{name}/").stdout
    expected = formulas_in_source(name)
    assert expected > 0
    assert dom.count("<math") == expected
    text = re.sub(r"<pre.*?</pre>|<code.*?</code>|alttext=\"[^\"]*\"", "", dom, flags=re.S)
    assert not re.search(r"\\\(|\\\[|\$\$", text), "raw LaTeX left in the page"
    shot = tmp_path / f"{name}.png"
    chromium("--hide-scrollbars", "--window-size=1300,2400", f"--screenshot={shot}",
             f"{served}/{name}/")
    assert shot.stat().st_size > 10_000  # a page with text on it, not a blank frame


# Added to a copy of a page: once it has loaded, each display's alttext and heights, as JSON.
PROBE = """<script>
addEventListener("load", () => {
  const rows = [...document.querySelectorAll(".math-display")].map(
    e => [e.firstElementChild.getAttribute("alttext"), e.scrollHeight, e.clientHeight]);
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify(rows);
  document.body.append(out);
});
</script>"""


@pytest.mark.parametrize("width", [1300, 700], ids=["wide", "narrow"])
@pytest.mark.parametrize("name", PAGES)
def test_no_display_equation_scrolls_vertically(served, site, name, width):
    """In Chromium every display equation had a small vertical scroll bar beside it: its
    content overflowed its box by 1 to 5 pixels (docs/stylesheets/extra.css says why).
    Each display's content now fits its height, wide and narrow."""
    page = site / name / "index.html"
    probe = page.with_name("_probe.html")
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"),
                     encoding="utf-8")
    try:
        dom = chromium(f"--window-size={width},2400", "--virtual-time-budget=5000",
                       "--dump-dom", f"{served}/{name}/_probe.html").stdout
    finally:
        probe.unlink()
    rows = json.loads(html.unescape(re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)[1]))
    assert len(rows) == math_in_source(name)[0]
    scrolling = [(latex, height, box) for latex, height, box in rows if height > box]
    assert not scrolling, f"taller than their box (scrollHeight, clientHeight): {scrolling}"
