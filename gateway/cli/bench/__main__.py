"""``python -m gateway.cli.bench`` runs the same command as ``kvpool bench``."""

from gateway.cli.bench.cli import bench_command

bench_command()
