"""The architecture document is in the repository and every citation of it names a real section; nothing
cites a design document outside the repository."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
CITATION = re.compile(r"docs/architecture\.md § ([A-Z][\w -]*\w)")


def cited_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "kiln").rglob("*.py")), *sorted((ROOT / "kiln").rglob("*.cpp")),
            *sorted((ROOT / "kiln").rglob("*.h")), *sorted((ROOT / "bench").glob("*.py"))]


def test_every_citation_of_the_architecture_names_one_of_its_sections():
    sections = {line.removeprefix("## ").strip() for line in ARCHITECTURE.read_text().splitlines() if line.startswith("## ")}
    broken = [f"{path.relative_to(ROOT)}: § {name}" for path in cited_files()
              for name in CITATION.findall(path.read_text()) if name not in sections]
    assert not broken, f"citations of sections docs/architecture.md lacks ({sorted(sections)}): {broken}"


def test_nothing_cites_the_design_brief_outside_the_repository():
    offenders = [str(path.relative_to(ROOT)) for path in cited_files() if "DESIGN.md" in path.read_text()]
    assert not offenders
