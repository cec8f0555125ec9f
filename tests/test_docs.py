"""The README against the code: its two commands, the subcommands it shows and its links (the
settings reference, docs/SETTINGS.md, is generated from the types: tests/test_settings.py).

Fast (no training, no imports of the package): these read files only.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"
CLI = ROOT / "lightning_islands" / "app" / "cli.py"


def _readme() -> str:
    return README.read_text(encoding="utf-8")


def _section(text: str, heading: str) -> str:
    """The body of the markdown section whose heading line is ``heading`` (up to the next heading of
    the same or a higher level)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == heading:
            level = len(heading) - len(heading.lstrip("#"))
            body = []
            for rest in lines[i + 1:]:
                m = re.match(r"^(#+) ", rest)
                if m and len(m.group(1)) <= level:
                    break
                body.append(rest)
            return "\n".join(body)
    raise AssertionError(f"README.md has no section {heading!r}")


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)


def _commands(section: str) -> tuple[str, str]:
    """The train and the test command of the README's Two commands section."""
    blocks = [b.strip() for b in _code_blocks(section)]
    train = [b for b in blocks if "lightning-islands train" in b]
    test = [b for b in blocks if "pytest" in b]
    assert len(train) == 1 and len(test) == 1, "Two commands: expected one train and one test command"
    return train[0], test[0]


def _steps(command: str) -> list[list[str]]:
    """A ``&&`` chain as a list of argument lists, with what does not change the meaning dropped:
    ``python -m`` before pip and pytest, quiet flags, pytest's ``-p PLUGIN`` switches."""
    steps = []
    for part in command.split("&&"):
        words = shlex.split(part)
        if words[:2] == ["python", "-m"] and len(words) > 2 and words[2] in ("pip", "pytest"):
            words = words[2:]
        words = [w for w in words if w != "-q"]
        if words and words[0] == "pytest":
            out, skip = [], False
            for w in words:
                if skip:
                    skip = False
                elif w == "-p":
                    skip = True
                else:
                    out.append(w)
            words = out
        if words:
            steps.append(words)
    return steps


def _ci_lines() -> list[str]:
    return [line.split("#", 1)[0].strip() for line in CI.read_text(encoding="utf-8").splitlines()]


def _ci_steps(pattern: str) -> list[list[str]]:
    found = [line for line in _ci_lines() if re.search(pattern, line)]
    assert found, f".ci/run has no line matching {pattern!r}"
    return [s for line in found for s in _steps(line.replace(" || exit 1", ""))]


def test_the_readme_test_command_is_what_ci_runs():
    _, test = _commands(_section(_readme(), "## Two commands"))
    readme = _steps(test)
    # the package, ruff and pytest: the line .ci/run marks as the README's test command
    ci_tail = _ci_steps(r"pip install .*-e .*\[test\]")
    assert ci_tail, ".ci/run does not install the test extra"
    n = len(ci_tail)
    assert readme[-n:] == ci_tail, f"README test command ends {readme[-n:]}, .ci/run runs {ci_tail}"
    # the pinned torch and triton that .ci/run installs first
    (pins,) = [s for s in _ci_steps(r"pip install .*torch==") if "torch" in " ".join(s)]
    assert pins in readme, f".ci/run installs {pins}, the README's test command does not"
    # a fresh virtual environment, as .ci/run makes
    assert readme[:2] == [["python3", "-m", "venv", ".venv"], [".", ".venv/bin/activate"]]


def test_the_readme_train_command_uses_the_same_torch():
    train, test = _commands(_section(_readme(), "## Two commands"))
    steps = _steps(train)
    torch_pin = lambda cmd: [w for s in _steps(cmd) for w in s if w.startswith("torch==")]  # noqa: E731
    assert torch_pin(train) == torch_pin(test) != [], "the two commands pin different torch builds"
    assert steps[:2] == [["python3", "-m", "venv", ".venv"], [".", ".venv/bin/activate"]]
    assert ["pip", "install", "-e", "."] in steps
    assert steps[-1] == ["lightning-islands", "train"]


def _cli_commands() -> set[str]:
    """The subcommands ``lightning_islands.app.cli.main`` dispatches (``command == "..."``)."""
    tree = ast.parse(CLI.read_text(encoding="utf-8"))
    (main,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    names = set()
    for node in ast.walk(main):
        if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "command"
                and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq)
                and isinstance(node.comparators[0], ast.Constant)):
            names.add(node.comparators[0].value)
    assert names, "found no subcommands in lightning_islands/app/cli.py"
    return names


def test_every_subcommand_the_readme_shows_exists():
    text = _readme()
    code = _code_blocks(text) + re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    shown = {m for chunk in code for m in re.findall(r"\blightning-islands\s+([a-z][\w-]*)", chunk)}
    assert shown, "the README shows no lightning-islands subcommand"
    missing = shown - _cli_commands()
    assert not missing, f"the README shows subcommands the CLI does not have: {sorted(missing)}"


def test_the_readme_links_to_sections_that_exist():
    def anchors(path: Path) -> set[str]:
        out = set()
        for line in path.read_text(encoding="utf-8").splitlines():
            if re.match(r"^#{1,6} ", line):
                title = line.lstrip("#").strip().lower()
                out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
        return out

    text = _readme()
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
        path = ROOT / target if target else README
        assert path.exists(), f"README links to {target}, which does not exist"
        assert anchor in anchors(path), f"README links to {target or 'README.md'}#{anchor}, no such heading"


def test_every_islands_metric_the_code_logs_is_in_the_metrics_reference():
    source = "\n".join(p.read_text() for p in (ROOT / "lightning_islands").rglob("*.py"))
    logged = set(re.findall(r'"(islands/[a-z_0-9]+)"', source))
    link_totals = re.search(r"LINK_TOTALS = \(([^)]*)\)", source)
    assert link_totals, "LINK_TOTALS moved: read the per-link metric names from where they are now"
    for name in re.findall(r'"([a-z_]+)"', link_totals.group(1)):  # islands/{key} and islands/total_{key}
        logged |= {f"islands/{name}", f"islands/total_{name}"}
    page = (ROOT / "docs" / "METRICS.md").read_text()
    listed = set(re.findall(r"`(islands/[a-z_0-9]+)`", page))
    assert len(logged) > 25 and not logged - listed, f"docs/METRICS.md lacks {sorted(logged - listed)}"
    assert not listed - logged, f"docs/METRICS.md lists metrics the code does not log: {sorted(listed - logged)}"


def test_the_readme_stays_a_guide_and_the_benchmarks_page_stays_current():
    assert len(_readme()) <= 15_000, "README.md is over 15,000 characters: move reference material to docs/"
    lines = len((ROOT / "docs" / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines())
    assert lines < 600, f"docs/BENCHMARKS.md has {lines} lines: keep each question's current table, drop the rest"


def test_every_environment_variable_the_code_reads_is_in_the_environment_reference():
    source = "\n".join(p.read_text() for p in (ROOT / "lightning_islands").rglob("*.py"))
    read = set(re.findall(r"\b(LI_[A-Z_]+|LIGHTNING_ISLANDS_[A-Z_]+)\b", source))
    page = (ROOT / "docs" / "ENVIRONMENT.md").read_text()
    listed = set(re.findall(r"`((?:LI|LIGHTNING_ISLANDS)_[A-Z_]+)`", page))
    assert len(read) >= 10 and read == listed, (sorted(read - listed), sorted(listed - read))
