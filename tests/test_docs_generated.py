"""The committed generated documents are what the engine produces today
(regenerate: python -m symacct.report.reference docs).

Sheets (md, tex, json), SVG plots and docs/rules-of-thumb.md must be byte-identical. PNG plots are
compared pixel by pixel: their bytes depend on the FreeType build inside the installed matplotlib
wheel, so at most 1 % of the pixels may differ (anti-aliasing of glyph edges); a stale plot (other
data, other labels) differs in far more.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.image import imread

from symacct.report.reference import write_all

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_generated_docs_are_fresh(tmp_path):
    written = write_all(tmp_path)
    fresh = {p.relative_to(tmp_path) for p in written}
    committed = {p.relative_to(DOCS) for p in (DOCS / "sheets").iterdir() if p.name != "README.md"}
    committed.add(Path("rules-of-thumb.md"))
    assert fresh == committed, "regenerate with: python -m symacct.report.reference docs"
    stale = []
    for rel in sorted(fresh):
        new, old = tmp_path / rel, DOCS / rel
        if rel.suffix == ".png":
            a, b = imread(new), imread(old)
            if a.shape != b.shape or np.mean(np.any(np.abs(a - b) > 1 / 255, axis=-1)) > 0.01:
                stale.append(str(rel))
        elif new.read_bytes() != old.read_bytes():
            stale.append(str(rel))
    assert not stale, f"stale: {stale}; regenerate with: python -m symacct.report.reference docs"


def test_sheets_readme_lists_every_reference_config():
    from symacct.report.reference import SHEETS

    readme = (DOCS / "sheets" / "README.md").read_text()
    for cfg in SHEETS:
        assert f"[{cfg.model}.md]({cfg.model}.md)" in readme
        assert f"B = {cfg.B}" in readme
