"""The docs stay true: every module path README.md and docs/ name exists, and
docs/architecture.md says the bands as tests/house.py's BANDS does and names every worker
verb in its spine table."""

from __future__ import annotations

import re
from pathlib import Path

from house import BANDS

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
EXAMPLE = "snapshot"          # docs/architecture.md's "Add a verb" names files to be written
NOT_MODULES = {"tpufab.yaml", "tpufab.yml"}


def _exists(dotted: str) -> bool:
    """A module or package of the tree, or a name in one (tpufab.config.TIMEOUTS), or a
    name of the package's public API (tpufab.create)."""
    import tpufab

    parts = dotted.split(".")
    if len(parts) == 2 and parts[1] in tpufab.API:
        return True
    for i in range(len(parts), 1, -1):
        base = REPO.joinpath(*parts[:i])
        if base.with_suffix(".py").is_file() or base.is_dir():
            return True
    return False


def test_every_module_path_the_docs_name_exists():
    stale = {}
    for doc in DOCS:
        text = doc.read_text()
        paths = {m.rstrip(".") for m in re.findall(r"(?<![\w./-])(tpufab(?:/[\w.-]+)+/?)", text)}
        names = set(re.findall(r"(?<![\w./-])(tpufab(?:\.[a-z_]\w*)+)", text)) - NOT_MODULES
        missing = sorted(p for p in paths if EXAMPLE not in p and not (REPO / p).exists())
        missing += sorted(n for n in names if not _exists(n))
        if missing:
            stale[doc.relative_to(REPO).as_posix()] = missing
    assert not stale, f"module paths the docs name that do not exist: {stale}"


def test_the_architecture_says_the_bands_as_the_band_test_checks_them():
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text[text.index("## The bands"):text.index("## The tree")]
    block = section[section.index("```\n") + 4:section.index("\n```", section.index("```\n"))]
    said = []
    for line in block.splitlines():
        name, folders = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        said.append((name, tuple(f.split(" ")[0] for f in folders.split(", "))))
    assert said == [(name, prefixes) for name, prefixes in BANDS]


def test_the_spine_table_names_every_worker_verb():
    from tpufab.verbs import all_verbs

    text = (REPO / "docs" / "architecture.md").read_text()
    table = text[text.index("## The Pod is the spine"):text.index("**One declaration")]
    named = set(re.findall(r"\| `([a-z -]+)`|, `([a-z -]+)`", table))
    named = {a or b for a, b in named}
    missing = sorted(v.path for v in all_verbs() if v.pod_method and v.path not in named)
    assert not missing, f"worker verbs the spine table of docs/architecture.md lacks: {missing}"
