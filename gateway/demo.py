"""The README's "run it" command on the embedded default: a managed Redis, the filesystem store, a generated model.

Starts a redis-server of its own in the state folder, opens the store, makes sure the
demo model exists, and prints the store's state. Grows into ``kvpool up`` plus a real
request as the pool takes shape.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from store.cli import human
from store.errors import StoreError
from store.fingerprint import fingerprint_file
from store.redis_server import RedisServer
from store.settings import StoreSettings
from store.store import Store
from worker.genmodel import ensure_model


def main() -> int:
    settings = StoreSettings()
    console = Console()
    model = ensure_model("tiny", settings.state_dir / "models")
    console.print(f"model   {model} ({human(model.stat().st_size)}, {fingerprint_file(model)})")
    with RedisServer(settings.state_dir / "redis", persist=True) as redis_server:
        console.print(f"redis   {redis_server.url} (managed, pid {redis_server.proc.pid if redis_server.proc else '-'})")
        try:
            with Store.open(settings.model_copy(update={"redis_url": redis_server.url})) as store:
                stats = store.stats()
        except StoreError as e:
            console.print(f"[red]{e}[/red]")
            return 1
    t = Table(title="kvpool store (embedded default)", show_header=False)
    for k, v in stats.items():
        t.add_row(k, human(v) if k in ("bytes", "max_bytes") else str(v))  # type: ignore[arg-type]
    console.print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
