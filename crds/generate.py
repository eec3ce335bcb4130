"""Copy the one hand-written CRD, `crds/pagedmodel.yaml`, to where else it must be: the chart's `crds/`
(Helm installs only what is inside the chart) and the operator package (package data: the operator reads
its defaults from it). `python3 crds/generate.py` writes the copies; `--check` only says which differ
(exit 1), as tests/operator/test_crd.py does.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "crds" / "pagedmodel.yaml"
COPIES = (REPO / "charts" / "pagedmodel" / "crds" / "pagedmodel.yaml", REPO / "operator" / "crd.yaml")


def stale_copies() -> list[Path]:
    """The copies whose bytes are not the source's."""
    source = SOURCE.read_bytes()
    return [copy for copy in COPIES if not copy.is_file() or copy.read_bytes() != source]


def main(argv: list[str]) -> int:
    stale = stale_copies()
    if "--check" in argv:
        for copy in stale:
            print(f"{copy.relative_to(REPO)} differs from {SOURCE.relative_to(REPO)}: run python3 crds/generate.py")
        return 1 if stale else 0
    for copy in stale:
        copy.write_bytes(SOURCE.read_bytes())
        print(f"wrote {copy.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
