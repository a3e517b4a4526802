"""The seam between the store's loaders and their consumers (the trainer, the audit): :class:`StepLoader`.

A loader of steps is an iterable of :class:`~rollshard.store.loader.config.Step` with a state to checkpoint
and resume from, told the policy version as the trainer moves on (torchtitan's ``BaseDataLoader(Stateful,
ABC)``). What a consumer reads of it is declared here, nothing else: the datasets it reads, the counts of its
last finished epoch, and two figures for a progress bar. The loaders: :class:`~rollshard.store.loader.RolloutLoader`
(one dataset), :class:`~rollshard.store.loader.mixture.MixtureLoader` (several, by weight) and
:class:`~rollshard.store.loader.follow.FollowLoader` (a dataset while it is written).

An epoch that yields no step is said by type, never by text: :class:`NoStepWarning` when the loader's run
ends without a step from it, :class:`NoStepError` when a loader that repeats forever (``num_epochs=None``)
would loop on it.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from rollshard.store.io.dataset import RolloutDataset
    from rollshard.store.loader.config import Step


class NoStepWarning(UserWarning):
    """An epoch (or a mixture) yields no step under the loader's settings; the message says why and what to
    loosen."""


class NoStepError(ValueError):
    """The data yields no step under the settings, where the caller cannot go on without one (an endless loader's
    epoch, or a trainer that never took a step)."""


class StepLoader(abc.ABC):
    """Steps of whole GRPO groups, resumable; see the module docstring."""

    @abc.abstractmethod
    def __iter__(self) -> Iterator["Step"]:
        """The steps from the current cursor on (the loader's own threads read ahead)."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The cursor after the last step taken: what :meth:`load_state_dict` resumes from."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict | list[dict]) -> None:
        """Resume from :meth:`state_dict` (this rank's, or every rank's list); a state of other settings is
        refused in one line."""

    @abc.abstractmethod
    def set_current_version(self, version: str | int) -> None:
        """The trainer's policy version; the steps planned from now on filter staleness against it."""

    @property
    @abc.abstractmethod
    def datasets(self) -> list["RolloutDataset"]:
        """The datasets read (one; a mixture's sources in order)."""

    @property
    def epoch_stats(self) -> dict[str, float]:
        """The filter counts of the last finished epoch (empty before one ends, and for a loader without
        epochs)."""
        return {}

    @property
    def num_groups(self) -> int | None:
        """Groups in the data per epoch (before filters); None where unknown (data still being written)."""
        return None

    @property
    def groups_before_end(self) -> int | None:
        """Groups drawn before the run ends when that is not ``num_groups x num_epochs`` (a mixture ends when its
        first source does); None otherwise."""
        return None

    def stop_waiting(self) -> None:
        """End a wait for data to be written (a Ctrl-C's handler calls it); a loader that never waits ignores it."""

    def close(self) -> None:
        """Stop the loader's threads; iteration can start again later from the cursor."""


class WrappedLoader(StepLoader):
    """A loader that hands on another's steps and state: subclass it and override :meth:`__iter__` to change the
    steps on their way (fill a field in, fail on purpose in a test)."""

    def __init__(self, inner: StepLoader):
        self.inner = inner

    def __iter__(self) -> Iterator["Step"]:
        return iter(self.inner)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict | list[dict]) -> None:
        self.inner.load_state_dict(state)

    def set_current_version(self, version: str | int) -> None:
        self.inner.set_current_version(version)

    @property
    def datasets(self) -> list["RolloutDataset"]:
        return self.inner.datasets

    @property
    def epoch_stats(self) -> dict[str, float]:
        return self.inner.epoch_stats

    @property
    def num_groups(self) -> int | None:
        return self.inner.num_groups

    @property
    def groups_before_end(self) -> int | None:
        return self.inner.groups_before_end

    def stop_waiting(self) -> None:
        self.inner.stop_waiting()

    def close(self) -> None:
        self.inner.close()
