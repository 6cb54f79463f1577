"""The README and docs/ stay true to the tree.

* every ``kvstore COMMAND --option`` they show (code blocks, inline code, and the option tables under
  a ``kvstore COMMAND`` heading of docs/cli.md) exists in that command's ``--help``;
* every relative link points at an existing file (and heading, for ``page.md#anchor``);
* every file they cite (``experiments/...``, ``tests/...``, ``kvstore/...``; a bare result name such as
  ``s3_load.json``; ``git show SHA:path`` for removed ones) exists;
* every path in docs/code-map.md's tree exists;
* docs/results.md is what ``python -m experiments report`` renders from the committed results, and
  every committed result is in the schema and produced by a suite;
* the README stays a front page (at most 300 lines).
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvstore.cli.main import app

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "experiments" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS = set(app.list_commands(None))  # type: ignore[arg-type]
OPTION = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")
# bare file names the docs mention that are not committed results (they name inputs, or the soak's
# own output files, or removed results cited through `git show`)
PLACEHOLDER = re.compile(r"(?<![A-Za-z])(NAME|SUITE|STEM|FILE|DIR)(?![A-Za-z])")  # in examples: bench_NAME.py
NOT_RESULTS = {"config.json", "results.json", "results.md", "s3_load_run1.json", "s3_sample_run1.json", "e2e.json"}


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@functools.cache
def help_options(command: str) -> frozenset[str]:
    result = CliRunner().invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    return frozenset(OPTION.findall(result.output))


def code_spans(text: str) -> list[str]:
    """Inline code spans and the lines of fenced code blocks."""
    spans, fence = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if fence:
            spans.append(line.split(" # ")[0])  # a shell comment is prose
        else:
            spans += re.findall(r"`([^`]+)`", line)
    return spans


def command_mentions(text: str) -> list[tuple[str, str]]:
    """(command, option) for every option written after ``kvstore COMMAND`` in code."""
    out = []
    for span in code_spans(text):
        for piece in re.split(r"&&|\|\||;|\$\(|\|(?!\|)", span):
            m = re.search(r"(?:^|\s)(?<!from )kvstore\s+([a-z][\w-]*)(.*)", piece)
            if m and m.group(1) in COMMANDS:
                out += [(m.group(1), opt) for opt in OPTION.findall(m.group(2))]
    return out


def table_options(text: str) -> list[tuple[str, str]]:
    """(command, option) from the first column of the option tables under ``## `kvstore X ...```."""
    out, command = [], None
    for line in text.splitlines():
        heading = re.match(r"#+ `kvstore ([a-z][\w-]*)", line)
        if heading:
            command = heading.group(1) if heading.group(1) in COMMANDS else None
        elif line.startswith("#"):
            command = None
        elif command and line.startswith("| `-"):
            first = line.split("|")[1]
            out += [(command, opt) for opt in OPTION.findall(first)]
    return out


def test_documented_options_exist_in_help():
    mentions = [(doc, c, o) for doc in DOCS for c, o in command_mentions(doc.read_text())]
    mentions += [(ROOT / "docs/cli.md", c, o) for c, o in table_options((ROOT / "docs/cli.md").read_text())]
    assert len(mentions) > 50, "the docs show kvstore commands with options: the parser found too few"
    wrong = sorted({f"{rel(doc)}: kvstore {c} {o}" for doc, c, o in mentions if o not in help_options(c)})
    assert not wrong, "options the docs show that `kvstore COMMAND --help` does not list:\n" + "\n".join(wrong)


def test_documented_commands_exist():
    named = {m.group(1) for doc in DOCS for span in code_spans(doc.read_text())
             for m in re.finditer(r"(?:^|\s)(?<!from )kvstore\s+([a-z][a-z-]+)\b(?![./:])", span)}  # fmt: skip
    ignore = {"error", "warning"}  # "kvstore: error: ..." lines
    assert not (named - COMMANDS - ignore), f"commands the docs show that do not exist: {named - COMMANDS - ignore}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text, fence, out = path.read_text(), False, set()
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


def links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_relative_links_resolve():
    broken = []
    for doc in DOCS:
        for target in links(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{rel(doc)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{rel(doc)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def ignored(paths: list[str]) -> set[str]:
    """The paths git ignores (outputs the docs name, such as cache/ folders)."""
    out = subprocess.run(["git", "check-ignore", "--stdin"], cwd=ROOT, input="\n".join(paths), capture_output=True,
                         text=True)  # fmt: skip
    return set(out.stdout.split())


def test_cited_files_exist():
    pattern = re.compile(r"(?<![\w/.:-])((?:experiments|tests|kvstore|cli|scripts|docs)/[\w./*{},-]*[\w/*}])")
    cited: dict[str, Path] = {}
    for doc in DOCS:
        if doc.name == "results.md":  # generated from the results; `experiments check` covers them
            continue
        text = re.sub(r"git show\s+[0-9a-f]{7,40}:\S+", "", doc.read_text())  # checked below
        for path in pattern.findall(text):
            cited.setdefault(path.split("::")[0].rstrip("."), doc)
    skip = ignored(sorted(cited))
    missing = []
    for path, doc in sorted(cited.items()):
        if path in skip or path.startswith("kvstore/cli") or PLACEHOLDER.search(path):  # kvstore/cli: cli/ installed
            continue
        if "{" in path:
            head, alts, tail = re.match(r"(.*)\{(.*)\}(.*)", path).groups()  # type: ignore[union-attr]
            candidates = [head + a + tail for a in alts.split(",")]
        else:
            candidates = [path]
        for c in candidates:
            if not (list(ROOT.glob(c)) if "*" in c else (ROOT / c).exists()):
                missing.append(f"{rel(doc)}: {c}")
    assert len(cited) > 40, "the docs cite files: the parser found too few"
    assert not missing, "files the docs cite that do not exist:\n" + "\n".join(missing)


def test_cited_result_names_exist():
    results = ROOT / "experiments" / "results"
    missing = []
    for doc in DOCS:
        for name in re.findall(r"`([\w-]+\.(?:json|png))`", doc.read_text()):
            if name not in NOT_RESULTS and not (results / name).exists():
                missing.append(f"{rel(doc)}: {name}")
    assert not missing, "result files the docs name that are not in experiments/results/:\n" + "\n".join(missing)


def test_results_cited_in_the_source_exist():
    """Comments and docstrings that quote a measurement name its result file: it must exist."""
    missing = []
    for folder in ("kvstore", "cli", "experiments"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name in re.findall(r"experiments/results/([\w.-]+\.\w+)", path.read_text()):
                if not (ROOT / "experiments" / "results" / name).exists():
                    missing.append(f"{rel(path)}: experiments/results/{name}")
    assert not missing, "result files the source cites that do not exist:\n" + "\n".join(missing)


def test_removed_results_cited_from_history():
    """Figures from results removed from the tree name the commit that holds them."""
    refs = {m for doc in DOCS for m in re.findall(r"git show\s+([0-9a-f]{7,40}:[\w./-]+)", doc.read_text())}
    assert refs, "the docs cite removed results through `git show SHA:path`"
    for ref in sorted(refs):
        sha = ref.split(":")[0]
        if subprocess.run(["git", "cat-file", "-e", f"{sha}^{{commit}}"], cwd=ROOT).returncode != 0:
            pytest.skip(f"commit {sha} is not in this clone (shallow?)")
        assert subprocess.run(["git", "cat-file", "-e", ref], cwd=ROOT).returncode == 0, f"no {ref}"


def code_map_paths(text: str) -> list[str]:
    block = text.split("```", 2)[1].split("\n", 1)[1]
    paths, parents = [], []
    for line in block.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        names = re.split(r"\s{2,}", line.strip())[0]
        parents = parents[:depth]
        for name in (n.strip() for n in names.split(",")):
            paths.append("".join(parents) + name)
        if names.endswith("/"):
            parents.append(names)
    return paths


def test_code_map_matches_tree():
    paths = code_map_paths((ROOT / "docs" / "code-map.md").read_text())
    assert len(paths) > 40
    missing = [p for p in paths if not list(ROOT.glob(p.rstrip("/")))]
    assert not missing, f"docs/code-map.md names paths that do not exist: {missing}"


def experiments(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments", *args], cwd=ROOT, capture_output=True, text=True)


def test_results_page_is_current():
    out = experiments("report", "--check")
    assert out.returncode == 0, out.stderr + "run: python -m experiments report"


def test_committed_results_follow_the_schema():
    out = experiments("check")
    assert out.returncode == 0, out.stderr


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines; the reference belongs in docs/"
