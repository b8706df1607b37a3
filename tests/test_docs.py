"""Every command that README.md and docs/ show names a real script or module, real files and real flags."""

import functools
import importlib.util
import re
import shlex
import subprocess
import sys

import pytest

from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FOLDERS = ("configs", "data", "heads", "benchmarks", "scripts", "notebooks", "mtp", "tests")
REPO_PATH = re.compile(rf"(?<![\w/.-])((?:{'|'.join(FOLDERS)})/[\w./-]+)")  # a path into the repository


def commands(text: str) -> list[str]:
    """The shell commands of a Markdown page: the lines of its bash blocks (continuations joined, comments and
    prompts dropped) and the inline code spans that run python or a script."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].strip()
            if line and not line.startswith("#"):
                found.append(line)
    found += [
        span for span in re.findall(r"`([^`\n]+)`", text) if re.match(r"(\.venv/bin/)?python3? |bash scripts/", span)
    ]
    return found


def invocation(command: str) -> tuple[list[str], list[str]] | None:
    """(the program's own arguments up to its options, every argument) of a python or scripts/ command; None for
    other programs (pip, git, jupyter, ...) and for `python -c`."""
    try:
        words = shlex.split(command)
    except ValueError:  # a shell construct shlex cannot read: checked by eye
        return None
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # environment settings
        words = words[1:]
    if not words:
        return None
    if words[0] == "bash" and len(words) > 1:
        return [words[1]], words[1:]
    if not re.fullmatch(r"(\.venv/bin/)?python3?", words[0]) or len(words) < 2 or words[1] == "-c":
        return None
    head = words[1:3] if words[1] == "-m" else words[1:2]
    if head == ["train.py"] and len(words) > 2 and not words[2].startswith("-"):
        head = words[1:3]  # train.py's subcommand: fit, validate, ...
    return head, words[1:]


@functools.cache
def help_text(head: tuple[str, ...]) -> str:
    result = subprocess.run([sys.executable, *head, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(head)} --help failed:\n{result.stderr[-2000:]}"
    return result.stdout


CASES = [
    pytest.param(page, command, id=f"{page.name}:{command[:60]}")
    for page in PAGES
    for command in commands(page.read_text())
    if invocation(command) is not None
]


def test_the_pages_show_commands():
    assert len(CASES) >= 20 and {case.values[0].name for case in CASES} >= {"README.md"}


@pytest.mark.slow
@pytest.mark.parametrize("page,command", CASES)
def test_a_documented_command_names_real_files_and_flags(page, command):
    head, words = invocation(command)
    program = head[1] if head[0] == "-m" else head[0]
    if head[0] == "-m":
        assert importlib.util.find_spec(program) is not None, f"{page.name}: no module {program}"
    else:
        assert (ROOT / program).is_file(), f"{page.name}: no script {program}"
    for word in words:
        for path in re.findall(REPO_PATH, word):
            assert (ROOT / path).exists(), f"{page.name}: {path} does not exist ({command})"
    if program.endswith(".sh"):
        return
    text = help_text(tuple(head))
    for flag in (word.split("=")[0] for word in words if word.startswith("--")):
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), f"{page.name}: {program} has no {flag}"
