"""``scripts/copy_venv.py``: the copy of a virtualenv that ``scripts/setup.sh`` keeps once per machine and makes a
fresh clone's ``.venv`` from. The copy runs as if created where it lies; the original is left as it was."""

import os
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPY = [sys.executable, str(ROOT / "scripts" / "copy_venv.py")]


def make_venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    script = path / "bin" / "where"  # as pip writes a console script: the venv's own python in its #! line
    script.write_text(f"#!{path}/bin/python\nimport sys\nprint(sys.prefix)\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return path


def tree(path: Path) -> dict[str, bytes]:
    files = [f for f in sorted(path.rglob("*")) if f.is_file() and not f.is_symlink()]
    return {str(f.relative_to(path)): f.read_bytes() for f in files}


def test_the_copy_runs_from_its_new_path_and_the_original_is_unchanged(tmp_path):
    src = make_venv(tmp_path / "cache" / "venv-dev-0123")
    before = tree(src)
    dst = tmp_path / "clone" / ".venv"
    dst.parent.mkdir()
    subprocess.run([*COPY, str(src), str(dst)], check=True)
    assert subprocess.run([dst / "bin" / "where"], capture_output=True, text=True, check=True).stdout == f"{dst}\n"
    assert subprocess.run([dst / "bin" / "python", "-c", "import sys; print(sys.prefix)"], capture_output=True,
                          text=True, check=True).stdout == f"{dst}\n"  # fmt: skip
    assert f'VIRTUAL_ENV="{dst}"' in (dst / "bin" / "activate").read_text()
    assert f" {dst}\n" in (dst / "pyvenv.cfg").read_text()  # the command that made it, as if made there
    assert os.readlink(dst / "bin" / "python") == os.readlink(src / "bin" / "python")  # still the base interpreter
    assert tree(src) == before
    assert subprocess.run([src / "bin" / "where"], capture_output=True, text=True, check=True).stdout == f"{src}\n"
    assert sorted(p.name for p in dst.parent.iterdir()) == [".venv"]  # nothing of the copy left beside it


def test_an_existing_destination_or_a_folder_that_is_no_venv_is_refused_in_one_line(tmp_path):
    src = make_venv(tmp_path / "venv")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine").write_text("kept")
    for args, message in [((src, taken), f"{taken} exists"), ((taken, tmp_path / "new"), "is not a virtualenv")]:
        p = subprocess.run([*COPY, *map(str, args)], capture_output=True, text=True)
        assert p.returncode == 1 and p.stderr.count("\n") == 1 and message in p.stderr, p.stderr
    assert (taken / "mine").read_text() == "kept" and sorted(p.name for p in taken.iterdir()) == ["mine"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken", "venv"]
