"""Prepared requests and their prefix-aware schedule: groups sharing a first chunk, each with a leader."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from gateway.batch.lines import Parsed, Rejected, request_result_id
from gateway.errors import APIError, internal_error, map_exceptions
from gateway.prepare import Prepared, Preparer
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.tenants import Tenant

log = logging.getLogger("kvpool.batch")


@dataclass
class Request:
    """A line that became a job spec, with the reuse its place in the schedule allows."""

    line: int
    custom_id: str
    prepared: Prepared
    want_logprobs: bool
    ideal: int = 0

    @property
    def result_id(self) -> str:
        return request_result_id(self.custom_id)

    @property
    def chain(self) -> list[str]:
        return self.prepared.spec.chain


def prepare(parsed: Parsed, preparer: Preparer, tenant: Tenant) -> Request | Rejected:
    """Validate the body and build its job, as the API would; failures keep the API's status and error body.

    The body is validated inside `map_exceptions`, as FastAPI validates a request's, so a
    bad body gets the message and param the HTTP API answers it with.
    """
    try:
        with map_exceptions():
            req = (ChatCompletionRequest if parsed.chat else CompletionRequest).model_validate(parsed.body)
        if isinstance(req, ChatCompletionRequest):
            return Request(parsed.line.number, parsed.custom_id, preparer.chat(req, tenant), req.logprobs)
        return Request(parsed.line.number, parsed.custom_id, preparer.completion(req, tenant), req.logprobs is not None)
    except APIError as e:
        err = e
    except Exception as e:  # a bug, not the body: a 500 for this line, the others go on
        log.exception("batch.prepare_failed", extra={"line": parsed.line.number})
        err = internal_error(e)
    return Rejected(parsed.line.number, request_result_id(parsed.custom_id), parsed.custom_id, err.code or "invalid_body", err.message, err)


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.count = 0


def _insert(root: _Node, chain: list[str]) -> int:
    """Add ``chain`` to the trie; returns how many of its leading keys were already there."""
    node, depth, known = root, 0, True
    for key in chain:
        child = node.children.get(key)
        if child is None:
            child = node.children[key] = _Node()
            known = False
        elif known:
            depth += 1
        child.count += 1
        node = child
    return depth


def _sharing(root: _Node, chain: list[str]) -> int:
    """Sum over the other chains in the trie of the full chunks each shares with ``chain``."""
    node, total = root, 0
    for key in chain:
        node = node.children[key]
        total += node.count - 1
    return total


@dataclass
class Group:
    """Requests sharing at least their first chunk; the leader runs first, its siblings after it."""

    leader: Request | None
    siblings: deque[Request] = field(default_factory=deque)
    leader_job: str | None = None
    leader_done: bool = False

    @property
    def leader_running(self) -> bool:
        return self.leader_job is not None and not self.leader_done


def plan(requests: list[Request], chunk_size: int) -> list[Group]:
    """Group by first chain key, pick each group's leader, and set every request's ideal reuse.

    The leader is the member sharing the most full chunks with the others (a trie over
    the chain keys counts them in one pass), so its published chunks cover as much of
    the group's shared prefix as any member's would. Requests without a full chunk, or
    sharing none, are groups of one.
    """
    trie = _Node()
    for r in requests:
        _insert(trie, r.chain)
    slots: list[Request | list[Request]] = []
    shared: dict[str, list[Request]] = {}
    for r in requests:
        if not r.chain or trie.children[r.chain[0]].count == 1:
            slots.append(r)
        elif r.chain[0] in shared:
            shared[r.chain[0]].append(r)
        else:
            shared[r.chain[0]] = [r]
            slots.append(shared[r.chain[0]])
    return [Group(leader=s) if isinstance(s, Request) else _lead(s, trie, chunk_size) for s in slots]


def _lead(members: list[Request], trie: _Node, chunk_size: int) -> Group:
    """The group in schedule order (leader, then siblings by line); each ideal counts what runs before it."""
    leader = max(members, key=lambda r: _sharing(trie, r.chain))
    group = Group(leader=leader, siblings=deque(r for r in members if r is not leader))
    scheduled = _Node()
    for r in [leader, *group.siblings]:
        r.ideal = min(_insert(scheduled, r.chain) * chunk_size, len(r.prepared.spec.tokens) - 1)
    return group
