"""Every exception the worker package raises on purpose, in one tree (catch `WorkerError` for any)::

    WorkerError
    ├── JobRejected            a job that can never succeed here: not retried
    ├── JobAborted             a job stopped between two steps of the engine loop (its client cancelled)
    ├── StateError             the sequence state, between kvpool and llama.cpp
    │   ├── StateFormatError   bytes that are not a state or payload kvpool can cut or join
    │   ├── StateReadError     llama.cpp could not write the sequence's state
    │   └── StateRestoreError  llama.cpp did not load the whole state
    ├── ModelError             the model file
    │   ├── PackagedModelError the packaged model could not be had, or is not what it should be
    │   └── ModelChecksumError the model from the bucket is not the file its sha256 names
    └── WorkerNameTaken        another live worker is registered under this name

They keep the built-in base each had (`ValueError` for a format error, `RuntimeError`
for the rest), so callers that caught those still do.
"""

from __future__ import annotations


class WorkerError(Exception):
    """Base of the worker package's exceptions."""


class JobRejected(WorkerError):
    """A job that can never succeed (wrong model, keys that disagree with the tokens, too long): not retried."""


class StateError(WorkerError):
    """The sequence state could not be read, understood or loaded."""


class StateFormatError(StateError, ValueError):
    """A state blob or payload is not in the layout `worker.engine.kvstate` and `worker.cache.kvchunks` understand."""


class StateReadError(StateError, RuntimeError):
    """llama.cpp could not write the sequence's state."""


class StateRestoreError(StateError, RuntimeError):
    """llama.cpp did not load the whole blob; the sequence has been left empty."""


class ModelError(WorkerError, RuntimeError):
    """The model file could not be had, or is not the file it should be."""


class PackagedModelError(ModelError):
    """The package could not be downloaded, or what came does not match its pinned digest."""


class ModelChecksumError(ModelError):
    """The model downloaded from the bucket is not the file its sha256 names."""


class WorkerNameTaken(WorkerError, RuntimeError):
    """Another live worker is registered under this name."""


class JobAborted(WorkerError):
    """The job stopped between two steps of the engine loop: its client cancelled or left (`worker.engine.loop`)."""
