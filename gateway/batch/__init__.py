"""Batches of OpenAI requests (``kvpool batch``, in `gateway.batch.cli`): answer a file of OpenAI batch requests over the worker pool, prefix-aware and resumable.

Input lines are OpenAI batch requests (``custom_id``, ``method``, ``url``, ``body``);
output lines are OpenAI batch results, appended, flushed and fsynced one by one as
requests finish. Every result carries an id derived from its request (its ``custom_id``,
or for a line that has no usable one, its number and text), so a rerun of the same
command after an interruption skips whatever the output file already answers.

Scheduling is prefix-aware. Two requests that share any full chunk share the first one,
so requests are grouped by the first key of their chain. Each group's leader (the member
sharing the most chunks with the others) runs first with ``wait_for_publish``; its
siblings are RQ dependents of its job and fan out over every worker once its chunks are
in the store, so a shared prefix is evaluated once per batch rather than once per worker.
The number of jobs submitted and not yet answered stays bounded, so a batch never fills
the queues that interactive requests go through.

What whole-chunk sharing allows (the "ideal"): for each request, the full chunks it shares
with a request scheduled before it in its group, at most its prompt less one token (the
last prompt token is always evaluated). The summary compares reused tokens with it.

Bodies are checked and prepared exactly as the HTTP API does it; ``stream`` is ignored
(a result is always a whole response).
"""

from gateway.batch.lines import Line, Parsed, Rejected, parse_all, read_lines
from gateway.batch.plan import Group, Request, plan
from gateway.batch.results import ResultFile, Tally

__all__ = [
    "Group",
    "Line",
    "Parsed",
    "Rejected",
    "Request",
    "ResultFile",
    "Tally",
    "parse_all",
    "plan",
    "read_lines",
]
