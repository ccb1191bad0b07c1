"""The documentation cannot drift from the code: the site builds strictly, and every code block
of the README and the tutorials runs (or, where it cannot run here, is checked statically).

A block's handling is written in the page, on the line after its closing fence:

- no marker: run as written (``bash``: one script with ``set -euo pipefail``; ``python``: a
  script); ``text`` blocks are output and are not run;
- ``<!-- docs-test: run ARGS -->``: run, with ARGS (small settings) appended to every
  ``fedpriv run|sweep|tune|audit`` command of the block;
- ``<!-- docs-test: fails N [ARGS] -->``: run, and the block must exit with code N;
- ``<!-- docs-test: file NAME -->``: the block is a file the page's later blocks use: written
  to NAME (Python compiled, TOML parsed);
- ``<!-- docs-test: static (REASON) -->``: cannot run here (installs, Docker, long-lived
  servers): bash is syntax-checked and every repository path it names must exist; Python is
  compiled; TOML parsed.

Each page's blocks run in order in a scratch folder of their own holding a link to ``configs/``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = sorted((ROOT / "docs" / "tutorials").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "docs" / "getting-started.md", *TUTORIALS]
FMNIST = Path("/usr/share/datasets/fashion-mnist")
LANGUAGES = ("bash", "python", "toml", "text")
MARKER = re.compile(r"^<!-- docs-test: (run|fails|file|static)\b\s*(.*?)\s*-->$")
FEDPRIV_COMMAND = re.compile(r"^(\s*(?:\w+=\S+\s+)*fedpriv\s+(?:run|sweep|tune|audit)\b)(.*)$")
REPO_PATH = re.compile(r"(?<![\w/.-])((?:configs|deploy|docs|tests|benchmarks)/[\w./{},-]+)")


@dataclass
class Block:
    page: Path
    line: int
    language: str
    code: str
    mode: str = "run"
    arg: str = ""

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    lines = page.read_text().split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if not lines[i].lstrip().startswith("```"):
            i += 1
            continue
        start, indent = i, len(lines[i]) - len(lines[i].lstrip())  # a block in a list item
        language = lines[i].strip()[3:].strip()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
        code = "\n".join(line[indent:] for line in lines[start + 1:end]) + "\n"
        block = Block(page, start + 1, language, code)
        marker = MARKER.match(lines[end + 1].strip()) if end + 1 < len(lines) else None
        if marker:
            block.mode, block.arg = marker.group(1), marker.group(2)
        blocks.append(block)
        i = end + 1
    return blocks


def with_small_settings(code: str, args: str) -> str:
    """``args`` appended to every fedpriv run/sweep/tune/audit command (continuation lines
    joined; a trailing ``# comment`` kept after them)."""
    if not args:
        return code
    joined = code.replace("\\\n", " ")
    out = []
    for line in joined.split("\n"):
        match = FEDPRIV_COMMAND.match(line)
        if match:
            command, comment = match.group(2), ""
            if " #" in command:
                command, comment = command.split(" #", 1)
                comment = " #" + comment
            line = f"{match.group(1)}{command.rstrip()} {args}{comment}"
        out.append(line)
    return "\n".join(out)


def static_check(block: Block) -> None:
    if block.language == "bash":
        checked = subprocess.run(["bash", "-n"], input=block.code, text=True,
                                 capture_output=True)
        assert checked.returncode == 0, f"{block.where()}: bash syntax: {checked.stderr}"
        for path in REPO_PATH.findall(block.code):
            for each in _brace_expanded(path.rstrip(".,")):
                assert (ROOT / each).exists() or each.startswith("deploy/certs"), \
                    f"{block.where()}: names {each}, which the repository does not have"
    elif block.language == "python":
        compile(block.code, block.where(), "exec")
    elif block.language == "toml":
        tomllib.loads(block.code)


def _brace_expanded(path: str) -> list[str]:
    match = re.search(r"\{([^}]*)\}", path)
    if not match:
        return [path]
    return [p for option in match.group(1).split(",")
            for p in _brace_expanded(path[:match.start()] + option + path[match.end():])]


def run_block(block: Block, work: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(work)}
    expected, args = 0, block.arg
    if block.mode == "fails":
        code, _, args = block.arg.partition(" ")
        expected = int(code)
    if block.language == "bash":
        script = "set -euo pipefail\n" + with_small_settings(block.code, args)
        command = ["bash", "-c", script]
    else:
        script_path = work / f"_block_{block.line}.py"
        script_path.write_text(block.code)
        command = [sys.executable, str(script_path)]
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == expected, (
        f"{block.where()}: exit {done.returncode}, expected {expected}\n--- script\n"
        f"{' '.join(map(shlex.quote, command))[:2000]}\n--- output\n"
        f"{(done.stdout + done.stderr)[-4000:]}")


def test_every_block_says_what_it_is():
    """Every fenced block has a language the test knows, and a marker the test knows."""
    for page in PAGES:
        for block in blocks_of(page):
            assert block.language in LANGUAGES, \
                f"{block.where()}: a code block needs one of {LANGUAGES}, not {block.language!r}"
            if block.mode == "file":
                assert block.arg and "/" not in block.arg, block.where()
            if block.mode == "fails":
                assert block.arg.split()[0].isdigit(), block.where()
            if block.mode == "static":
                assert block.arg.startswith("(") and block.arg.endswith(")"), \
                    f"{block.where()}: a static block says why it cannot run: (REASON)"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_blocks_run(page: Path, tmp_path: Path):
    blocks = blocks_of(page)
    runnable = [b for b in blocks if b.language != "text" and b.mode in ("run", "fails")]
    if "fashion-mnist" in "".join(b.code for b in runnable) and not FMNIST.is_dir():
        pytest.skip("needs Debian's dataset-fashion-mnist (apt-get install dataset-fashion-mnist)")
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    for block in blocks:
        if block.language == "text":
            continue
        if block.mode == "static":
            static_check(block)
        elif block.mode == "file":
            (tmp_path / block.arg).write_text(block.code)
            static_check(block)
        elif block.language == "toml":
            tomllib.loads(block.code)  # a config shown, not a command: it must parse
        else:
            run_block(block, tmp_path)


def test_readme_is_short_and_reaches_the_first_pages_in_one_click():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.split("\n")) <= 300
    links = set(re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme))
    for page in ("docs/getting-started.md", "docs/tutorials/first-run.md",
                 "docs/tutorials/own-data.md", "docs/tutorials/own-model.md",
                 "docs/tutorials/own-algorithm.md"):
        assert page in links, f"the README does not link {page}"
    for link in links:
        if not link.startswith("http"):
            assert (ROOT / link).exists(), f"README links {link}, which does not exist"


def test_the_site_builds_strictly(tmp_path: Path):
    """``mkdocs build --strict``: a broken link, a page outside the navigation, a docstring
    mkdocstrings cannot read or a missing anchor fails the build."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "tutorials" / "own-data" / "index.html").is_file()
    keys = (tmp_path / "site" / "algorithms" / "deep" / "index.html").read_text()
    assert "clip-quantile" in keys and "fedpriv-keys" not in keys  # the generated tables
