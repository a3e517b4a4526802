"""The built wheel holds every module of the three stages (package-dir mapping trap, see setup.py)."""

import pathlib
import shutil
import subprocess
import sys
import textwrap
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
STAGES = ("generate", "store", "train")


def source_modules() -> set[str]:
    mods = set()
    for stage in STAGES:
        for py in (ROOT / stage).rglob("*.py"):
            rel = py.relative_to(ROOT / stage).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mods.add(".".join(["rollshard", stage, *parts]))
    return mods


def test_wheel_contains_and_imports_every_module(tmp_path):
    # Build from a copy so the build's own folders never land in (or race with) the work tree.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "__pycache__", "build", "dist", "*.egg-info", "runs", "demo"))
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(src)],
        check=True,
        capture_output=True,
    )
    [wheel] = (tmp_path / "dist").glob("rollshard-*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path / "site")
        names = z.namelist()
    in_wheel = {
        n[: -len(".py")].replace("/", ".").replace(".__init__", "")
        for n in names
        if n.endswith(".py") and n.startswith("rollshard/")
    }
    expected = {m for m in source_modules() if not m.endswith(".__main__")}
    assert expected <= in_wheel, f"missing from the wheel: {sorted(expected - in_wheel)}"
    assert any(n.startswith("rollshard/generate/tasks/data/") and n.endswith(".jsonl") for n in names) or not (
        ROOT / "generate" / "tasks" / "data"
    ).exists()

    # Import every module from the unpacked wheel with the editable finder removed.
    script = textwrap.dedent(
        f"""
        import importlib, sys
        sys.meta_path = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
        sys.path_hooks = [h for h in sys.path_hooks if "editable" not in repr(h)]
        sys.path.insert(0, {str(tmp_path / "site")!r})
        for name in {sorted(expected)!r}:
            mod = importlib.import_module(name)
            assert mod.__file__.startswith({str(tmp_path / "site")!r}), (name, mod.__file__)
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"
