"""The committed documents generated from the engine: ``docs/sheets/`` and ``docs/rules-of-thumb.md``.

``python -m symacct.report.reference docs`` regenerates them; ``tests/test_docs_generated.py``
regenerates them into a temporary folder and fails when the committed copies are stale.

The reference configurations (documented in ``docs/sheets/README.md``):

- ``gpt2``: GPT-2 small (124M, tied head, dropout 0.1), AdamW, bf16 autocast, B = 8, S = 1024;
- ``llama``: Llama 2 7B, the mixed-precision recipe (bf16 weights and grads, fp32 master, m, v),
  B = 1, S = 4096;
- ``cruncher``: the seed's MLP (L = 2 layers of 64), AdamW in fp32, B = 8.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from symacct.report.sheet import RENDERERS


@dataclass(frozen=True)
class SheetConfig:
    model: str  # built-in name or package.module:factory
    B: int
    S: int | None = None
    options: dict[str, Any] = field(default_factory=dict)  # derive's step options; dtypes by name
    overrides: dict[str, Any] = field(default_factory=dict)  # config fields
    C: int | None = None  # a decode step's cached positions (default S_max - 1)

    @property
    def name(self) -> str:
        """A file stem ('pkg.mod:make_net' -> 'make_net')."""
        stem = self.model.rpartition(":")[2] or self.model
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in stem)


SHEETS = (
    SheetConfig("gpt2", 8, 1024, {"optimizer": "adamw", "autocast": "bf16"}),
    SheetConfig("llama", 1, 4096, {"optimizer": "mixed_adamw", "params_dtype": "bf16"}),
    SheetConfig("cruncher", 8, None, {"optimizer": "adamw"}),
)


def make_sheet(cfg: SheetConfig, hardware: str = "H100-SXM", mfu: float = 0.5) -> tuple[Any, dict[str, Any]]:
    """Derive a model and build its sheet: ``symacct sheet`` and the reference sheets both come here."""
    import dataclasses

    from symacct.models.loading import load_model
    from symacct.pipeline import derive
    from symacct.report import sheet

    model = load_model(cfg.model, cfg.overrides)
    acct = derive(model, **cfg.options)
    config = getattr(model, "config", None)
    config = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else None
    return acct, sheet.build(acct, name=cfg.name, B=cfg.B, S=cfg.S, hardware=hardware, mfu=mfu, config=config, C=cfg.C)


def write_all(docs: Path) -> list[Path]:
    """Write every reference sheet (md, tex, json, plots) under ``docs/sheets`` and the rules-of-thumb page."""
    from symacct.report import sheet
    from symacct.report.check import catalog, render_md

    out = docs / "sheets"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for cfg in SHEETS:
        acct, sh = make_sheet(cfg)
        written += sheet.write(acct, sh, out, formats=list(RENDERERS))
    page = docs / "rules-of-thumb.md"
    page.write_text(render_md([c.as_dict() for c in catalog()]))
    return [*written, page]


if __name__ == "__main__":
    for p in write_all(Path(sys.argv[1] if len(sys.argv) > 1 else "docs")):
        print(p)
