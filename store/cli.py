"""``kvpool store``: inspect and maintain the store (stats, ls, verify, gc, reindex)."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from store.clitools import pass_settings
from store.errors import StoreError
from store.settings import StoreSettings
from store.store import Store

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """``"1.5GiB"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (try 500MB, 2GiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


@contextmanager
def open_store(settings: StoreSettings) -> Iterator[Store]:
    try:
        with Store.open(settings) as store:
            yield store
    except StoreError as e:
        raise click.ClickException(str(e)) from None


def _emit(as_json: bool, doc: Any, render: Callable[[], None]) -> None:
    if as_json:
        click.echo(json.dumps(doc, indent=2, default=str))
    else:
        render()


@click.group("store")
def store_group() -> None:
    """Inspect and maintain the prompt-state store."""


@store_group.command("stats")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@pass_settings(StoreSettings)
def stats_cmd(settings: StoreSettings, as_json: bool) -> None:
    """Chunks, bytes and namespaces held by the store, and bytes by the kernel fingerprint that computed them."""
    with open_store(settings) as store:
        s = store.stats()

    def render() -> None:
        t = Table(title="kvpool store", show_header=False)
        for k, v in s.items():
            if k == "bytes_by_kernels":  # the fleet's split: one row per kernel fingerprint
                for kernels, n in v.items():  # type: ignore[attr-defined]
                    t.add_row(f"bytes, kernels {kernels}", human(n))
                continue
            shown = human(v) if k in ("bytes", "max_bytes") else _when(v) if k.endswith("_access") else str(v)  # type: ignore[arg-type]
            t.add_row(k, shown)
        Console().print(t)

    _emit(as_json, s, render)


@store_group.command("ls")
@click.option("--limit", default=50, show_default=True, help="Most recently used chunks to list.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@pass_settings(StoreSettings)
def ls_cmd(settings: StoreSettings, limit: int, as_json: bool) -> None:
    """Chunks in the index, most recently used first."""
    with open_store(settings) as store:
        rows: list[dict[str, Any]] = []
        for e in store.index.entries():
            if len(rows) >= limit:
                break
            rows.append(
                {
                    "key": e.key.hex(),
                    "namespace": e.namespace.hex(),
                    "index": e.index,
                    "size": e.size,
                    "created": e.created,
                    "accessed": e.accessed,
                }
            )

    def render() -> None:
        t = Table(title=f"{len(rows)} chunks (most recently used first)")
        for col in ("key", "namespace", "chunk", "size", "created", "last access"):
            t.add_column(col)
        for r in rows:
            t.add_row(r["key"], r["namespace"][:12], str(r["index"]), human(r["size"]), _when(r["created"]), _when(r["accessed"]))
        Console().print(t)

    _emit(as_json, rows, render)


@store_group.command("verify")
@click.option("--repair", is_flag=True, help="Drop and quarantine bad blobs, forget missing ones.")
@pass_settings(StoreSettings)
def verify_cmd(settings: StoreSettings, repair: bool) -> None:
    """Read every indexed blob and check it. Exits 1 when something is wrong."""
    with open_store(settings) as store:
        r = store.verify(repair=repair)
    for name, why in r.bad:
        click.echo(f"BAD      {name}: {why}")
    for name in r.missing:
        click.echo(f"MISSING  {name}")
    click.echo(
        f"checked {r.checked} chunks: {len(r.bad)} bad, {len(r.missing)} missing"
        + (" (repaired)" if repair and (r.bad or r.missing) else "")
    )
    if (r.bad or r.missing) and not repair:
        sys.exit(1)


@store_group.command("gc")
@click.option("--max-bytes", "max_bytes", required=True, help="Byte budget, e.g. 20GB or 500MiB.")
@pass_settings(StoreSettings)
def gc_cmd(settings: StoreSettings, max_bytes: str) -> None:
    """Evict least recently used chunks (deepest first) until the store fits in the budget."""
    try:
        budget = parse_size(max_bytes)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--max-bytes") from None
    with open_store(settings) as store:
        r = store.gc(budget)
    click.echo(f"evicted {r.evicted_chunks} chunks ({human(r.evicted_bytes)}); {human(r.total_bytes)} stored, budget {human(budget)}")


@store_group.command("reindex")
@pass_settings(StoreSettings)
def reindex_cmd(settings: StoreSettings) -> None:
    """Rebuild the Redis index from the backend's listing (after Redis lost its data)."""
    with open_store(settings) as store:
        n = store.reindex()
        total = store.index.total_bytes()
    click.echo(f"indexed {n} chunks ({human(total)})")
