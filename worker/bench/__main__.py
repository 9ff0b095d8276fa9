"""``python -m worker.bench`` runs the same command as ``kvpool bench``."""

from worker.bench.cli import bench_command

bench_command()
