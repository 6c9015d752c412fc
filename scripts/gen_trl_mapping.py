"""Write the generated field table of docs/trl_mapping.md from ``FIELD_TO_YAML``.

    python scripts/gen_trl_mapping.py          # rewrite the section between the markers
    python scripts/gen_trl_mapping.py --check  # exit 1 when the doc is stale

Only the section between the markers is touched: the hand-written tables above it stay as they are.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpo_lightning.trl_compat.mapping_doc import updated

DOC = Path(__file__).resolve().parents[1] / "docs" / "trl_mapping.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the doc is current")
    args = parser.parse_args(argv)
    doc = DOC.read_text()
    new = updated(doc)
    if args.check:
        if new != doc:
            print(f"{DOC} is stale: run python scripts/gen_trl_mapping.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
