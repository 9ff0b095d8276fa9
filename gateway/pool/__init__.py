"""Running a whole pool on one machine: the tools, not the library.

`procs` starts and waits for every process kvpool runs (redis-server, the local S3
endpoint, workers, gateways, llama-server); `up` is `kvpool up`; `docs` and `envfile`
write the generated tables and `deploy/.env.example`; `bench/` measures the pool beside
llama-cpp-python and llama-server. It may import anything; nothing outside it (and the
root command's table) imports it, so a worker or gateway runs without it.
"""
