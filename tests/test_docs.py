"""Claims of the README and docs/ that the code or another doc can contradict, checked against their source: the
--method help and the methods' tables against the method table (opd.methods.table.METHODS), the departures' numbering and
groups (docs/DEPARTURES.md) against the items, and the departures the README and FAMILY.md cite against the list."""

import re
from pathlib import Path

import pytest

from opd.cli import build_parser
from opd.config import PRESETS, TrainConfig
from opd.methods.table import METHODS

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
FAMILY = (ROOT / "docs" / "FAMILY.md").read_text()
DEPARTURES = (ROOT / "docs" / "DEPARTURES.md").read_text()


def items() -> list[int]:
    """The numbers of DEPARTURES.md's items, in the order written."""
    return [int(n) for n in re.findall(r"^- \*\*(\d+)\. ", DEPARTURES, flags=re.M)]


def groups() -> dict[str, set[int]]:
    """DEPARTURES.md's group table: group name -> its items."""
    rows = re.findall(r"^\| \[([^\]]+)\]\(#[^)]*\) \| ([\d, ]+) \|$", DEPARTURES, flags=re.M)
    return {name: {int(n) for n in numbers.split(",")} for name, numbers in rows}


def numbers(text: str) -> set[int]:
    """The item numbers of a citation such as 'items 28-41, 43, 51-53 and 55-58'."""
    out = set()
    for a, b in re.findall(r"(\d+)(?:-(\d+))?", text):
        out |= set(range(int(a), int(b or a) + 1))
    return out


def table_rows(text: str, header: str) -> list[str]:
    """The first cells of the markdown table whose header row starts with `header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1].strip())
    return rows


def test_the_method_help_names_every_method_of_the_table():
    parser = build_parser(TrainConfig, PRESETS, "")
    action = next(a for a in parser._actions if "--method" in a.option_strings)
    listed = re.search(r"One of: ([^.]+)\.", action.help).group(1).split(", ")
    assert listed == list(METHODS)


@pytest.mark.parametrize(("doc", "header"), [(README, "| `--method` | paper"), (README, "| `--method` | LoRA"),
                                             (FAMILY, "| `--method` | paper")])  # fmt: skip
def test_every_method_has_its_row_in_the_docs_tables(doc, header):
    cells = table_rows(doc, header)
    named = {name for cell in cells for name in re.findall(r"`([a-z-]+)`", cell)}
    assert set(METHODS) <= named, set(METHODS) - named


def test_the_family_settings_table_has_a_column_per_method():
    header = next(line for line in FAMILY.splitlines() if line.startswith("| Setting | `bas-opd`"))
    columns = re.findall(r"`([a-z-]+)`", header)
    assert sorted(columns) == sorted(METHODS), set(METHODS) ^ set(columns)


def test_the_departures_are_numbered_once_and_each_is_in_one_group():
    found = items()
    assert sorted(found) == list(range(1, len(found) + 1)), "a number missing or repeated"
    listed = [n for group in groups().values() for n in group]
    assert sorted(listed) == sorted(found), "an item in no group, or in two"


def test_the_results_list_and_family_cite_departures_that_exist_and_count_them_right():
    total = len(items())
    stated = re.search(r"Every numbered departure \((\d+)\)", README)
    assert stated is None or int(stated.group(1)) == total  # no stale count (the README states none today)
    assert "## Departures that change results" in README and "docs/DEPARTURES.md" in README
    top = (ROOT / "docs" / "DEPARTURES.md").read_text()  # the list the README points to: above the group table
    section = top.split("**Those that can change a trained model or a reported number**")[1].split("| Group | Items |")[0]
    cited = numbers(" ".join(re.findall(r"(?:^- |; |^  )(\d+(?:-\d+)?): ", section, flags=re.M)))
    assert len(cited) > 20 and cited <= set(items()), cited - set(items())
    family = re.search(r"Where each method departs from its paper's code:\n.*?items ([^.]+)\.", FAMILY, flags=re.S)
    siblings = groups()["The sibling papers"]
    assert numbers(family.group(1)) == siblings, numbers(family.group(1)) ^ siblings


def test_the_paper_is_cited_by_its_arxiv_id_not_by_a_path_outside_the_repository():
    """A clone has no paper file beside it (the shared folder above the repository): the README, the docs and the code
    cite the paper by title and arXiv id."""
    files = [p for pattern in ("*.md", "docs/*.md", "opd/**/*.py", "*.py", "tests/*.py", "experiments/**/*.py")
             for p in ROOT.glob(pattern)]  # fmt: skip
    outside = "../" + "shared/paper"  # (spelled apart, so that this file does not name it)
    assert len(files) > 50 and not [str(p.relative_to(ROOT)) for p in files if outside in p.read_text()]
    title = ("BAS-OPD: Budget-Aware Selective On-Policy Self-Distillation for\nFine-Grained Multimodal Perception** "
             "(arXiv 2609.25891)")
    assert title in README
