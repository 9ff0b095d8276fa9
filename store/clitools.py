"""What every ``kvpool`` command shares: its settings, read once from ``KVPOOL_*`` variables and handed in.

``@pass_settings(GatewaySettings)`` gives a command its settings object as its first
argument, as rq's ``pass_cli_config`` hands each command its config. A bad value is a click
usage error naming the variable and what is wrong with it (not the value, which may be a
secret), never a traceback. The object is kept on the click context, so a command asking
for the class its group already read (or a base of it) gets that same object.

It lives in ``store`` so that ``store/cli.py``, which imports only ``store``, can use it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

import click
from pydantic import ValidationError
from pydantic_settings import BaseSettings

S = TypeVar("S", bound=BaseSettings)
P = ParamSpec("P")
R = TypeVar("R")


def variable(cls: type[BaseSettings], field: str) -> str:
    """The environment variable a field is read from: ``KVPOOL_CHUNK_SIZE`` for ``chunk_size``."""
    return f"{cls.model_config.get('env_prefix') or ''}{field}".upper()


def describe(cls: type[BaseSettings], error: ValueError) -> str:
    """``error`` as one line per bad variable: ``KVPOOL_PORT: Input should be a valid integer ...``."""
    if isinstance(error, ValidationError):
        problems = [f"{variable(cls, str(e['loc'][0])) if e['loc'] else cls.__name__}: {e['msg']}" for e in error.errors()]
        return "bad settings: " + "; ".join(problems)
    # pydantic-settings' SettingsError: a dict or list setting whose value is not JSON.
    field = re.search(r'field "(\w+)"', str(error))
    name = variable(cls, field.group(1)) if field else cls.__name__
    return f"bad settings: {name}: not valid JSON ({error.__cause__ or error})"


def load_settings(cls: type[S], ctx: click.Context | None = None) -> S:
    """The settings of the running command: the ``cls`` object its group already read, else ``cls`` read from the environment."""
    ctx = ctx or click.get_current_context()
    found = ctx.find_object(cls)
    if found is not None:
        return found
    try:
        settings = cls()
    except ValueError as e:  # pydantic's ValidationError, or pydantic-settings' SettingsError
        raise click.UsageError(describe(cls, e), ctx) from None
    ctx.obj = settings
    return settings


def pass_settings(cls: type[S]) -> Callable[[Callable[Concatenate[S, P], R]], Callable[P, R]]:
    """A click decorator: the command gets its ``cls`` settings as its first argument (see `load_settings`)."""

    def decorate(command: Callable[Concatenate[S, P], R]) -> Callable[P, R]:
        @functools.wraps(command)
        def with_settings(*args: P.args, **kwargs: P.kwargs) -> R:
            return command(load_settings(cls), *args, **kwargs)

        return with_settings

    return decorate
