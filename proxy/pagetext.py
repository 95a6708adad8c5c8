"""A fetched page as readable text or markdown: its main content, without navigation, ads and
scripts, by trafilatura (imported only when the direct fetcher is on: it costs ~16 MiB)."""

from __future__ import annotations

import logging
from typing import Any

import trafilatura

from policies.core.extract import PageFormat

# Pages that are text already, and what their content is as such.
TEXT_TYPES: dict[str, PageFormat] = {"text/plain": "text", "text/markdown": "markdown"}

# trafilatura and its date and URL parsers log every odd page at warning through the standard
# library; a page the proxy cannot read is reported in the answer, not the server's log.
for _name in ("trafilatura", "htmldate", "courlan", "justext"):
    logging.getLogger(_name).setLevel(logging.ERROR)


# What converting a page takes per tag ("<"), measured (lxml's tree and trafilatura's work on
# it, some 2 KB an element of open and close tags): a page of many tiny elements converts in
# hundreds of MB.
BYTES_PER_TAG = 1024


def conversion_cost(body: bytes, media: str) -> int:
    """The memory converting `body` (of media type `media`) takes, its bytes included."""
    return len(body) if media in TEXT_TYPES else len(body) + BYTES_PER_TAG * body.count(b"<")


def page_text(
    body: bytes, media: str, charset: str | None, fmt: PageFormat, url: str
) -> tuple[str, str, PageFormat]:
    """(title, content, the content's format) of a page's body as its Content-Type says; CPU
    bound (tens of milliseconds for a long page): call it off the event loop."""
    text_kind = TEXT_TYPES.get(media)
    if text_kind is not None:
        return "", _decode(body, charset), text_kind
    tree = trafilatura.load_html(body)
    if tree is None:
        return "", "", fmt
    title = _title(tree)
    content: str | None = trafilatura.extract(
        tree,
        url=url,
        output_format="markdown" if fmt == "markdown" else "txt",
        include_links=fmt == "markdown",
        include_tables=True,
        include_comments=False,
        favor_recall=True,
    )
    if not content:  # too little for its main-content rules: the page's whole text
        content = trafilatura.html2txt(body)
        fmt = "text"
    return title, (content or "").strip(), fmt


def _title(tree: Any) -> str:
    """The page's <title>, else its og:title, else its first heading."""
    for path in (".//title", ".//h1"):
        text = tree.findtext(path)
        if text and text.strip():
            return " ".join(text.split())
    og = tree.find(".//meta[@property='og:title']")
    return " ".join(str(og.get("content", "")).split()) if og is not None else ""


def _decode(body: bytes, charset: str | None) -> str:
    try:
        return body.decode(charset or "utf-8", "replace")
    except LookupError:  # a charset Python does not know
        return body.decode("utf-8", "replace")
