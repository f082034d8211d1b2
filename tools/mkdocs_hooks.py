"""MkDocs hooks for the documentation site (mkdocs.yml names this file).

The pages live in docs/ but sometimes point at the code, as in
``[einattn/bench/report.py](../einattn/bench/report.py)``: a link that works on GitHub and in
an editor, and that MkDocs' strict mode rejects because the target is not a page. Such a
link becomes a link to the file in the repository when mkdocs.yml sets ``repo_url``, and its
bare text otherwise. Links to files that do not exist are left alone, so strict mode still
fails on them.
"""

from __future__ import annotations

import re
from pathlib import Path

LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)\)")
FENCE = re.compile(r"(^```.*?^```[^\n]*$)", re.M | re.S)


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs = Path(config["docs_dir"]).resolve()
    root = Path(config["config_file_path"]).resolve().parent
    here = (docs / page.file.src_uri).parent
    repo_url = (config["repo_url"] or "").rstrip("/")

    def relink(m: re.Match) -> str:
        text, target = m.groups()
        path, _, anchor = target.partition("#")
        if not path or "://" in path or path.startswith("mailto:"):
            return m.group(0)
        file = (here / path).resolve()
        if file.is_relative_to(docs) or not file.is_relative_to(root) or not file.exists():
            return m.group(0)
        if not repo_url:
            return text
        anchor = f"#{anchor}" if anchor else ""
        return f"[{text}]({repo_url}/blob/HEAD/{file.relative_to(root).as_posix()}{anchor})"

    parts = FENCE.split(markdown)  # odd parts are fenced code: left as they are
    return "".join(p if k % 2 else LINK.sub(relink, p) for k, p in enumerate(parts))
