"""MkDocs hook: the key tables of an algorithm family's page, generated from the key declarations
at build time, so the pages cannot drift from the code. A line ``<!-- fedpriv-keys: NAME ... -->``
becomes the tables of the keys the named algorithms read (``fedpriv.keys.family_tables``)."""

from __future__ import annotations

import re

from fedpriv.keys import family_tables

MARKER = re.compile(r"^<!-- fedpriv-keys: ([a-z0-9 -]+) -->$", re.MULTILINE)


def on_page_markdown(markdown: str, **_: object) -> str:
    return MARKER.sub(lambda m: family_tables(m.group(1).split()), markdown)
