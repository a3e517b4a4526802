"""Where each step's metrics go: ``metrics.jsonl``, TensorBoard events and Weights & Biases.

:class:`MetricsLogger` (rank 0 only) hands every step to its backends, each with
``log(step, metrics, histograms)`` and ``close(exit_code)``:

* :class:`JsonlLogger`: one JSON object per step in ``OUT/metrics.jsonl``. Always on:
  ``--resume`` and the notebooks read it (:func:`read_metrics`).
* :class:`TensorBoardLogger`: the same scalars and the staleness histogram under ``OUT/tb``.
* :class:`WandbLogger`: the same scalars with ``step=`` the trainer step, and the staleness
  histogram, to a wandb run whose config is the run's resolved config. Its id and the last
  step it was given are kept in ``OUT/wandb_run.json``.

On resume, ``metrics.jsonl`` lines and TensorBoard events after the checkpoint's step are
dropped, so both read as one uninterrupted run. A torn last line of ``metrics.jsonl`` (the
process killed while writing it) is dropped there and skipped by :func:`read_metrics`; a bad
line before the last is an error naming it.

wandb cannot drop steps it already holds, so a resume continues the same run in one of two
ways (``--wandb-resume``). ``allow`` (the default) calls ``wandb.init(id=..., resume="allow")``
and logs only the steps after the last one the run was given. A step that ran between the
checkpoint and a crash keeps the values it was first logged with, while metrics.jsonl holds
those of the re-run (an exact resume gives the same numbers to float rounding). Steps wandb
holds are not sent again, whether it refuses them online or would take them twice offline.
``rewind`` calls ``wandb.init(resume_from="ID?_step=CHECKPOINT")``: wandb cuts the run's
history after the checkpoint's step and the later steps are logged again, as in metrics.jsonl.
W&B servers offer rewinding as a preview feature only.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import secrets
import shutil
import string
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from rollshard.store.common import write_atomic
from rollshard.store.inspection.views.metrics import read_metrics_lines

LOGGERS = ("jsonl", "tensorboard", "wandb")
METRICS_FILE = "metrics.jsonl"
WANDB_RUN_FILE = "wandb_run.json"
WANDB_MISSING = "--logger wandb needs wandb: pip install 'rollshard[wandb]'"
WANDB_PROJECT = "rollshard"
# wandb.Histogram takes at most 512 bins; staleness lags beyond that range are binned coarsely.
MAX_HISTOGRAM_BINS = 512


class Logger(Protocol):
    def log(self, step: int, metrics: dict[str, float], histograms: dict[str, list[float]]) -> None: ...

    def close(self, exit_code: int) -> None: ...


def require_loggers(names: tuple[str, ...]) -> None:
    """Raise ValueError with the install command when a logger's package is missing (before anything runs)."""
    if "wandb" in names and importlib.util.find_spec("wandb") is None:
        raise ValueError(WANDB_MISSING)


class MetricsLogger:
    """The per-step loggers of a run in ``out``: JSONL always, TensorBoard and wandb when asked. Rank 0 only
    (``enabled=False`` on the others). ``wandb`` is the config's wandb section (None: no wandb run),
    ``run_config`` the resolved config it logs as the run's config."""

    def __init__(
        self,
        out: str | Path,
        *,
        enabled: bool = True,
        tensorboard: bool = True,
        wandb: Any = None,
        run_config: dict[str, Any] | None = None,
        resume_step: int | None = None,
    ):
        self.enabled = enabled
        self.path = Path(out) / METRICS_FILE
        self.backends: list[Logger] = []
        if not enabled:
            return
        jsonl = JsonlLogger(out, resume_step=resume_step)  # reads (and checks) the old file; writes nothing yet
        remote: list[Logger] = []
        try:
            # wandb first: its init is what fails for reasons outside the run (no login, no network), and then
            # nothing in --out has been touched.
            if wandb is not None:
                remote.append(WandbLogger(out, wandb, run_config=run_config or {}, resume_step=resume_step))
            self.backends.append(jsonl.open())
            if tensorboard:
                self.backends.append(TensorBoardLogger(out, resume_step=resume_step))
        except BaseException:
            for backend in [*self.backends, *remote]:
                backend.close(exit_code=1)
            raise
        self.backends.extend(remote)

    def log(self, step: int, metrics: dict[str, float], *, histograms: dict[str, list[float]] | None = None) -> None:
        for backend in self.backends:
            backend.log(step, metrics, histograms or {})

    def close(self, exit_code: int = 0) -> None:
        """``exit_code``: 0 a finished run, 130 stopped by a signal, anything else failed (wandb's run state)."""
        backends, self.backends = self.backends, []
        for backend in backends:
            backend.close(exit_code)


class JsonlLogger:
    """``OUT/metrics.jsonl``: created from :meth:`open`, so a failure before it leaves the old file as it was."""

    def __init__(self, out: str | Path, *, resume_step: int | None):
        self.path = Path(out) / METRICS_FILE
        self.resume_step = resume_step
        self._kept = None
        if resume_step is not None and self.path.exists():
            read = read_metrics_lines(self.path)
            self._kept = [ln for ln, rec in zip(read.lines, read.values) if rec["step"] <= resume_step]

    def open(self) -> "JsonlLogger":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._kept is not None:  # the lines up to the checkpoint, replacing the file whole (a kill keeps one)
            write_atomic(self.path, "".join(ln + "\n" for ln in self._kept))
        elif self.resume_step is None and self.path.exists():
            self.path.unlink()  # a fresh run starts a fresh file
        self._file = self.path.open("a")
        return self

    def log(self, step: int, metrics: dict[str, float], histograms: dict[str, list[float]]) -> None:
        record = {"step": step, "time": time.time(), **{k: _finite(v) for k, v in sorted(metrics.items())}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self, exit_code: int) -> None:
        self._file.close()


class TensorBoardLogger:
    """Scalars and histograms under ``OUT/tb``; on resume, events after the checkpoint's step are purged."""

    def __init__(self, out: str | Path, *, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        purge = resume_step + 1 if resume_step is not None else None
        self.writer = SummaryWriter(str(Path(out) / "tb"), purge_step=purge)

    def log(self, step: int, metrics: dict[str, float], histograms: dict[str, list[float]]) -> None:
        import numpy as np

        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        for k, values in histograms.items():
            if values:
                self.writer.add_histogram(k, np.asarray(values, dtype=np.float64), step)
        self.writer.flush()

    def close(self, exit_code: int) -> None:
        self.writer.close()


class WandbLogger:
    """One wandb run per ``--out``, continued by ``--resume`` (the module docstring says how). Unset settings fall
    back to wandb's environment variables, then to ours: project ``rollshard``, the run named after the ``--out``
    folder, files under ``--out`` (``OUT/wandb``)."""

    def __init__(self, out: str | Path, settings: Any, *, run_config: dict[str, Any], resume_step: int | None):
        try:
            import wandb
        except ImportError as e:
            raise ValueError(WANDB_MISSING) from e
        self.out = Path(out)
        self.state_path = self.out / WANDB_RUN_FILE
        # A run restarted from step 0 in the same --out (killed before its first checkpoint) is still that wandb
        # run: a new one would orphan the steps it logged. Those steps are not sent again (allow), or cut (rewind).
        previous = _read_run_state(self.state_path)
        if previous is not None and resume_step is None:
            resume_step = 0
            print(f"rollshard-train: wandb: {out} restarts from step 0 (no checkpoint); continuing its wandb run "
                  f"{previous['id']}" + (", history cut to step 0" if settings.resume == "rewind" else
                  f", whose steps up to {previous['step']} keep the values logged before"), file=sys.stderr)
        root = Path(settings.dir or os.environ.get("WANDB_DIR") or self.out).expanduser()
        kw: dict[str, Any] = {
            "project": settings.project or os.environ.get("WANDB_PROJECT") or WANDB_PROJECT,
            "name": settings.name or os.environ.get("WANDB_NAME") or self.out.expanduser().resolve().name,
            "entity": settings.entity,  # None: WANDB_ENTITY, else the account's default
            "tags": list(settings.tags) if settings.tags else None,  # None: WANDB_TAGS
            "dir": str(root),
            "config": run_config,
            "allow_val_change": True,  # a resume may change settings (--max-steps): the config shows the latest
            "reinit": "create_new",  # never hand back another run of this process
        }
        if previous is None:
            kw["id"], self.logged = _new_run_id(), 0
        elif settings.resume == "rewind":
            kw["resume_from"], self.logged = f"{previous['id']}?_step={resume_step}", resume_step
        else:
            kw.update(id=previous["id"], resume="allow")
            self.logged = previous["step"]
        created = _Created(root / "wandb")
        try:
            self.run = wandb.init(**kw)
        except (wandb.errors.Error, ValueError, OSError) as e:  # wandb's own errors, bad settings, the file system
            created.remove()
            raise ValueError(
                f"--logger wandb: wandb could not start the run ({e}); log in with `wandb login` (or set "
                "WANDB_API_KEY), or log offline with WANDB_MODE=offline and upload later with `wandb sync`"
            ) from e
        self._wandb = wandb
        self.out.mkdir(parents=True, exist_ok=True)  # for wandb_run.json, when the wandb dir is elsewhere
        self.logged = max(self.logged, self.run.starting_step - 1)  # online: the steps the server already holds
        self._save_state()

    def log(self, step: int, metrics: dict[str, float], histograms: dict[str, list[float]]) -> None:
        if step <= self.logged:
            return  # logged before a crash: wandb holds it (see the module docstring)
        data: dict[str, Any] = {k: float(v) for k, v in metrics.items()}
        for k, values in histograms.items():
            if values:
                data[k] = self._wandb.Histogram(np_histogram=integer_histogram(values))
        self.run.log(data, step=step)
        self.logged = step
        self._save_state()

    def close(self, exit_code: int) -> None:
        try:
            self.run.finish(exit_code=exit_code)
        except (self._wandb.errors.Error, OSError, TimeoutError) as e:  # the run's data stays in its folder
            print(f"rollshard-train: warning: wandb could not finish the run ({e}); `wandb sync` uploads what it "
                  f"wrote under {self.run.dir}", file=sys.stderr)

    def _save_state(self) -> None:
        # Replaced whole, so a killed process leaves the old record or the new; not fsynced: it is rewritten
        # every step, and losing the last few to a power cut only re-sends steps wandb then refuses as old.
        write_atomic(self.state_path, json.dumps({"id": self.run.id, "step": self.logged}) + "\n", durable=False)


def integer_histogram(values: list[float]):
    """``(counts, edges)`` with one bin per integer (staleness lags), or 64 bins over a range wider than
    :data:`MAX_HISTOGRAM_BINS`."""
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    lo, hi = math.floor(v.min()), math.floor(v.max())
    if hi - lo + 1 > MAX_HISTOGRAM_BINS:
        return np.histogram(v, bins=64)
    return np.histogram(v, bins=np.arange(lo, hi + 2, dtype=np.float64) - 0.5)


class _Created:
    """What a failed ``wandb.init`` may have added under ``folder``, removed again (with ``folder`` and its parent
    when they did not exist before), so a failed start leaves ``--out`` as it was."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.parent_existed = folder.parent.exists()
        self.before = set(folder.iterdir()) if folder.is_dir() else None

    def remove(self) -> None:
        if self.before is None:
            if self.folder.is_dir():
                shutil.rmtree(self.folder)
        elif self.folder.is_dir():
            for entry in set(self.folder.iterdir()) - self.before:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        if not self.parent_existed and self.folder.parent.is_dir() and not any(self.folder.parent.iterdir()):
            self.folder.parent.rmdir()


def _new_run_id() -> str:
    """Eight base-36 characters, as wandb makes its own."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _read_run_state(path: Path) -> dict[str, Any] | None:
    """``{"id", "step"}`` of the run's wandb run, or None when the run had no wandb run."""
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text())
        return {"id": str(state["id"]), "step": int(state["step"])}
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path} is not a wandb run record ({e}); delete it to start a new wandb run on --resume"
        ) from e


def _finite(v: float) -> float | str:
    """JSON has no inf/NaN; write them as strings so a diverged step is still readable."""
    v = float(v)
    return v if math.isfinite(v) else str(v)


def read_metrics(out: str | Path) -> list[dict[str, Any]]:
    """The ``metrics.jsonl`` records of a run, in step order (a torn last line left out; another line that is not
    JSON raises a ValueError naming it: rollshard.store.inspection.views.metrics.read_metrics_lines)."""
    return read_metrics_lines(Path(out) / METRICS_FILE).values
