"""Bad input to ``lightning-islands`` is refused before anything starts, in one message that names
the argument, the value and the fix (no traceback); and ``--version``.

Fast: no island is launched (``run_islands`` is replaced by a double that fails the test if reached).
"""

from __future__ import annotations

import importlib.metadata
import socket
import sys
from pathlib import Path

import pytest

import lightning_islands
from lightning_islands.app import cli, launch

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10; the test extra installs tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if the launcher is reached: every check must come before it."""
    def launched(*args, **kwargs):
        pytest.fail(f"run_islands was reached with {args}, {kwargs}: an island would have started")

    monkeypatch.setattr(launch, "run_islands", launched)


def _main(argv: list[str], capsys) -> tuple[int, str]:
    """``lightning-islands ARGV``'s exit code and standard error."""
    try:
        code = cli.main(argv)
    except SystemExit as stop:  # argparse's errors exit
        code = stop.code
    return code, capsys.readouterr().err


# (arguments of `run` before `--`, what the message must say)
RUN_CASES = [
    (["--islands", "2,x"], ["--islands '2,x'", "'x' is not a whole number", "e.g. 2,1"]),
    (["--islands", "0,1"], ["--islands '0,1'", "island 0 has 0 processes", "each at least 1", "e.g. 2,1"]),
    (["--islands", "2,0"], ["--islands '2,0'", "island 1 has 0 processes", "e.g. 2,1"]),
    (["--islands", ""], ["--islands ''", "names no island", "e.g. 2,1"]),
    (["--islands", " , "], ["--islands ' , '", "names no island", "e.g. 2,1"]),
    (["--islands", "1.5"], ["--islands '1.5'", "'1.5' is not a whole number", "e.g. 2,1"]),
    (["--islands=2,-1"], ["--islands '2,-1'", "'-1' is not a whole number", "e.g. 2,1"]),
    (["--islands", "2", "--max-restarts", "-1"], ["--max-restarts", "-1"]),
    (["--islands", "1", "--link", "25gbps"], ["--link", "'25gbps' is ambiguous", "write 25gbit", "200gbit"]),
    (["--islands", "1", "--link", "fast,100ms"], ["--link", "'fast'", "e.g. 25gbit", "RATE[,RTT][,tuned]"]),
    (["--islands", "1", "--log-dir", "{tmp}/file/logs"],
     ["--log-dir", "'{tmp}/file/logs'", "{tmp}/file is a file, not a folder", "give a folder"]),
    (["--islands", "1", "--log-dir", "{tmp}/file"], ["--log-dir", "'{tmp}/file'", "it is a file", "give a folder"]),
    (["--islands", "1", "--log-dir", "{tmp}/file/a/b"], ["'{tmp}/file/a/b'", "{tmp}/file is a file"]),
    (["--islands", "1,1", "--coordinator", "etcd://h1:2379,h2"], ["--coordinator", "member 'h2' is not HOST:PORT",
                                                                  "etcd://10.0.0.1:2379"]),
    (["--islands", "1,1", "--coordinator", "etcd://h1:2379", "--link", "1gbit"], ["--coordinator and --link"]),
]


@pytest.mark.parametrize("argv, says", RUN_CASES)
def test_bad_run_input_is_refused_before_any_island_starts(argv, says, tmp_path, capsys, no_launch):
    (tmp_path / "file").write_text("a regular file\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, err = _main(["run", *argv, "--", sys.executable, "train.py"], capsys)
    assert code == 2
    for part in says:
        assert part.replace("{tmp}", str(tmp_path)) in err, err
    assert "Traceback" not in err and err.count("error:") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing made, no log written
    assert (tmp_path / "file").read_text() == "a regular file\n"


def test_no_command_is_refused_before_the_log_dir_is_made(tmp_path, capsys, no_launch):
    code, err = _main(["run", "--islands", "2,1", "--log-dir", str(tmp_path / "logs")], capsys)
    assert code == 2 and "give the command after --" in err and not (tmp_path / "logs").exists()


def test_good_run_input_reaches_the_launcher(tmp_path, capsys, monkeypatch):
    seen = {}

    def fake_run_islands(islands, command, **kwargs):
        seen.update(islands=islands, command=command, **kwargs)
        return []

    monkeypatch.setattr(launch, "run_islands", fake_run_islands)
    logs = tmp_path / "new" / "logs"  # a folder to be made is fine
    assert cli.main(["run", "--islands", " 2, 1 ", "--log-dir", str(logs), "--", "python", "x.py"]) == 0
    assert seen["islands"] == [2, 1] and seen["command"] == ["python", "x.py"] and seen["log_dir"] == str(logs)


# ----------------------------------------------------------------------------------------- coordinator
@pytest.fixture
def held_port():
    """A port that a listening socket on 127.0.0.1 holds for the test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _assert_port_message(code: int, err: str, port: int) -> None:
    assert code == 1
    assert err.count("\n") == 1 and "Traceback" not in err, err  # one line
    assert f"port {port} is already in use" in err and "choose another --port" in err
    assert "stop the process holding it" in err


def test_a_coordinator_port_in_use_is_one_line_naming_it(held_port, capsys):
    code, err = _main(["coordinator", "--host", "127.0.0.1", "--port", str(held_port)], capsys)
    _assert_port_message(code, err, held_port)


def test_a_port_taken_after_the_check_gives_the_same_line(held_port, capsys, monkeypatch):
    monkeypatch.setattr(launch, "port_in_use", lambda port, host="": False)  # as if taken between check and bind
    code, err = _main(["coordinator", "--host", "127.0.0.1", "--port", str(held_port)], capsys)
    _assert_port_message(code, err, held_port)


@pytest.mark.parametrize("port", ["-1", "65536"])
def test_a_coordinator_port_out_of_range_is_refused(port, capsys):
    code, err = _main(["coordinator", "--port", port], capsys)
    assert code == 2 and f"--port {port} is not a TCP port" in err and "0 to 65535" in err


def test_port_in_use_sees_a_listener_and_not_a_free_port(held_port):
    assert launch.port_in_use(held_port)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert not launch.port_in_use(free)


# ----------------------------------------------------------------------------------------- version
def _pyproject_version() -> str:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_installed_version(flag, capsys):
    assert cli.main([flag]) == 0
    out = capsys.readouterr().out
    assert out == f"lightning-islands {importlib.metadata.version('lightning-islands')}\n"
    assert "--version" in cli.USAGE and "-V" in cli.USAGE


def test_version_falls_back_to_the_package_version(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cli.version() == lightning_islands.__version__ == _pyproject_version()
