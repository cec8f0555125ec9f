"""The README against the code: its key table, its two commands and the subcommands it shows.

Fast (no training, no imports of the package): these read files only.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CONFIG = ROOT / "conf" / "islands" / "two_hetero.yaml"
CI = ROOT / ".ci" / "run"
CLI = ROOT / "lightning_islands" / "app" / "cli.py"
WORKER = ROOT / "lightning_islands" / "app" / "worker.py"


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


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def _key_table() -> dict[str, tuple[str, str]]:
    """The README's table of ``islands.*`` keys: key -> (meaning, default), code quotes removed."""
    body = _section(_readme(), "### Island settings")
    rows = [line for line in body.splitlines() if line.startswith("|")]
    assert rows, "README.md: the Island settings section has no table"
    assert _cells(rows[0]) == ["key", "meaning", "default"], f"unexpected table header: {rows[0]}"
    table = {}
    for row in rows[2:]:  # header, then the |---| line
        cells = _cells(row)
        assert len(cells) == 3, f"a key table row without three cells: {row}"
        key = cells[0].strip("`")
        assert key not in table, f"key {key!r} appears twice in the README's key table"
        table[key] = (cells[1], cells[2])
    return table


def _config() -> dict:
    return yaml.safe_load(CONFIG.read_text(encoding="utf-8"))


def _normalise(value: object) -> str:
    """A value as the table writes it: null, true/false, else str() (so 1.0 and 1 differ)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _member_fields() -> set[str]:
    """The fields of an ``islands.members`` entry that the worker reads."""
    source = WORKER.read_text(encoding="utf-8")
    fields = set(re.findall(r"""\bmember(?:\.get\(|\[)["'](\w+)["']""", source))
    fields |= set(re.findall(r"""["'](\w+)["'] in member\b""", source))
    assert fields, "found no member fields in lightning_islands/app/worker.py"
    return fields


def test_every_config_key_is_in_the_readme_table_and_back():
    table = {k for k in _key_table() if not k.startswith("members[")}
    config = set(_config())
    assert not config - table, f"islands.* keys missing from the README's key table: {sorted(config - table)}"
    assert not table - config, f"README key table rows that are not islands.* keys: {sorted(table - config)}"


def test_the_member_fields_in_the_readme_are_those_the_worker_reads():
    rows = {k for k in _key_table() if k.startswith("members[")}
    listed = set()
    for key in rows:
        m = re.fullmatch(r"members\[i\]\.(\w+)", key)
        assert m, f"write member rows as members[i].FIELD, not {key!r}"
        listed.add(m.group(1))
    worker = _member_fields()
    assert listed == worker, (f"README member fields {sorted(listed)} differ from those "
                              f"lightning_islands/app/worker.py reads: {sorted(worker)}")


@pytest.mark.parametrize("key", sorted(yaml.safe_load(CONFIG.read_text(encoding="utf-8"))))
def test_the_readme_default_is_the_config_value(key):
    table = _key_table()
    assert key in table, f"islands.{key} has no row in the README's key table"
    _, cell = table[key]
    written = cell.strip("`")
    value = _config()[key]
    if isinstance(value, (list, dict)):
        assert yaml.safe_load(written) == value, f"README default of {key}: {written}, config: {value}"
        return
    # YAML reads null/Null/~ as None and true/True as True; Python's None counts as null too (a bare
    # lowercase none stays the string it is in the config, e.g. balance: none)
    got = "null" if written == "None" else _normalise(yaml.safe_load(written))
    assert got == _normalise(value), f"README default of islands.{key} is {written}, conf says {_normalise(value)}"


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
