"""The math pages as a reader sees them: the built site, served on loopback, opened in
headless Chromium with every other host unreachable (no network, as on an offline laptop).

Every formula of the Markdown source (counted here from the source, independently of the
build) must be a ``<math>`` element in the page the browser holds, and no LaTeX delimiter
may be left in its text; a screenshot of each page goes to the test's temporary folder.
Skipped, saying why, where Chromium is not installed (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import functools
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


def formulas_in_source(page: str) -> int:
    """``$$…$$`` displays and ``$…$`` inline formulas of a page, code left out."""
    md = (DOCS / f"{page}.md").read_text(encoding="utf-8")
    md = re.sub(r"^```.*?^```", "", md, flags=re.S | re.M)
    md = re.sub(r"`[^`\n]*`", "", md)
    display = re.compile(r"^\$\$\n.*?\n\$\$$", re.S | re.M)
    n_display = len(display.findall(md))
    inline = re.findall(r"(?<![\\$])\$(?!\s)[^$\n]+?(?<!\s)\$", display.sub("", md))
    return n_display + len(inline)


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
