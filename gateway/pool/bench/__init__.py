"""``kvpool bench``: what sharing prompt state across a pool buys, measured against llama-cpp-python's own caches.

One run starts its own services (redis-server, an S3 endpoint, ``kvpool worker``
processes), drives the same deterministic workloads through every system on the same
model, threads and machine, interleaving the systems request by request so that drift
(thermal, page cache, a neighbour's load) hits all of them alike, and writes a table,
a JSON file with every sample, a Markdown report and plots.

Modules: `workloads` (the prompts), `services` (processes the run owns), `systems`
(how each system serves one request), `measure` (the physical floor, bytes per token,
hashing, the machine), `runner` (plan, interleaving, progress), `report` (outputs),
`cli` (the command).
"""
