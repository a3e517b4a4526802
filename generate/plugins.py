"""User code by import path or file: ``module:attr`` or ``path/to/file.py:attr``.

``--task``, ``--reward`` and ``--agents`` take either a built-in name or such a spec. A spec
with ``.py`` before the last ``:`` is a file (relative to the working directory), imported
under a private module name; anything else is imported as a module from ``sys.path``
(the working directory first, as ``python -m`` does). ``attr`` may be dotted
(``pkg.mod:Class.factory``).

Identity: every loaded plugin is recorded in the run config as ``{"spec", "file",
"sha256"}`` (the file that defines it, and the hash of its bytes), so a dataset names the
exact code that made it, and a resume with an edited plugin is refused (the run config's
``plugins`` key is one of the generation settings compared on resume). A module's
identity is the file of the module named in the spec: code it imports in turn is not
hashed.

Errors are :class:`PluginError` (a ``ValueError``), one line naming the spec and what to
fix; an exception raised while importing the user's file is reported with its type,
message and line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import sys
import traceback
from pathlib import Path
from typing import Any

from rollshard.store.common import file_sha256


class PluginError(ValueError):
    """A plugin spec that cannot be loaded; the message says which and why."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plugin:
    """A loaded user object and where it came from."""

    spec: str
    obj: Any
    file: str | None  # absolute path of the defining file (None: a module without a file)
    sha256: str | None

    @property
    def identity(self) -> dict[str, Any]:
        """What the run config records (and a resume compares)."""
        return {"spec": self.spec, "file": self.file, "sha256": self.sha256}


def is_spec(text: str) -> bool:
    """Whether ``text`` names user code (``module:attr`` / ``file.py:attr``) rather than a built-in name."""
    return ":" in text


def load(spec: str, *, what: str) -> Plugin:
    """Import ``spec`` (module docstring); ``what`` names the option in errors (e.g. ``--reward``)."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise PluginError(f"{what} {spec!r}: expected module:attr or path/to/file.py:attr")
    if target.endswith(".py"):
        module, file = _import_file(target, spec, what)
    else:
        module = _import_module(target, spec, what)
        file = getattr(module, "__file__", None)
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            public = sorted(n for n in vars(module) if not n.startswith("_"))[:12]
            raise PluginError(
                f"{what} {spec!r}: {target} has no attribute {attr!r} (it defines: {', '.join(public) or 'nothing'})"
            ) from None
    path = str(Path(file).resolve()) if file else None
    return Plugin(spec=spec, obj=obj, file=path, sha256=file_sha256(path) if path else None)


def _import_file(target: str, spec: str, what: str):
    path = Path(target).expanduser()
    if not path.is_file():
        raise PluginError(f"{what} {spec!r}: no such file {target} (relative paths are from {Path.cwd()})")
    path = path.resolve()
    # A private, path-derived module name: two plugin files called reward.py do not collide, and the module is in
    # sys.modules while it runs (dataclasses and pickling-free introspection look it up there).
    name = "rollshard_plugin_" + hashlib.blake2b(str(path).encode(), digest_size=6).hexdigest()
    if name in sys.modules:
        return sys.modules[name], str(path)
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise PluginError(f"{what} {spec!r}: {target} cannot be imported as Python")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:
        sys.modules.pop(name, None)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise PluginError(f"{what} {spec!r}: importing {target} raised {_where(e, path)}") from e
    return module, str(path)


def _import_module(target: str, spec: str, what: str):
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # `module:attr` finds modules next to the user, as `python -m` does
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name and target.startswith(e.name):
            hint = f"no module {e.name!r} on the path (is it installed, or is the working directory right?)"
            raise PluginError(f"{what} {spec!r}: {hint}; for a file write path/to/file.py:{spec.rpartition(':')[2]}")
        raise PluginError(f"{what} {spec!r}: importing {target} raised {_where(e, None)}") from e
    except Exception as e:
        raise PluginError(f"{what} {spec!r}: importing {target} raised {_where(e, None)}") from e


def _where(error: BaseException, path: Path | None) -> str:
    """``Type: message (file.py line N)``: the innermost frame in the plugin's file (or the last one)."""
    text = " ".join(str(error).split()) or "no message"
    frames = traceback.extract_tb(error.__traceback__)
    if isinstance(error, SyntaxError) and error.lineno:
        return f"SyntaxError: {error.msg} ({Path(error.filename or '?').name} line {error.lineno})"
    mine = [f for f in frames if path is not None and Path(f.filename) == path] or frames[-1:]
    at = f" ({Path(mine[-1].filename).name} line {mine[-1].lineno})" if mine else ""
    return f"{type(error).__name__}: {text}{at}"
