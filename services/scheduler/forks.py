"""The n choices of one request: how they share their prompt's KV. Every fork rule of the scheduler.

The first choice prefills the prompt, the others fork it. The gateway submits choice 0, then the
others with `fork_of` naming it. A later choice waits until choice 0 has computed all of the prompt
but its last token, then starts on the same attention worker with its KV table forked from choice
0's (`SeqWork.fork_of`: the blocks are shared, and copied when either sequence writes into a shared
one) and feeds only the prompt's last token, whose logits it samples from with its own seed. So the
prompt is prefilled once for n choices, and each choice's tokens are exactly those of a request of
its own.

Not shared (the choice prefills the prompt itself): when it asks for the prompt's logprobs (they come
from the prefill's rows) or for a repetition penalty (its sampler must see the whole prompt), when it
is a continuation, and when choice 0 is gone or was recomputed elsewhere before the fork was sent.
A parent's KV is released only after every fork sent with or after it (`forked_later`), and the
choices past the first are never shed apart from choice 0 (`follows_choice_zero`).
"""

from __future__ import annotations

from collections.abc import Iterable

from services.scheduler.registry import AttentionLane
from services.scheduler.state import RequestState, Status


def shares_prompt(parent: RequestState | None, child: RequestState) -> bool:
    """Whether `child` may fork `parent`'s prompt KV (now or once `parent` has prefilled it)."""
    return (parent is not None and not parent.finished and parent.prompt_ids == child.prompt_ids
            and len(child.prompt_ids) >= 2 and child.base_tokens == 0 and child.sampling.prompt_logprobs is None
            and not child.sampling.has_repetition_penalty)


def prefilled(parent: RequestState) -> bool:
    """`parent`'s worker holds its prompt but the last token: a fork can start now."""
    return (parent.status is Status.RUNNING and parent.worker_id is not None
            and parent.num_computed >= len(parent.prompt_ids) - 1)


def follows_choice_zero(state: RequestState) -> bool:
    """One of choices 1..n-1: it goes (and is shed) with choice 0, never apart from it."""
    return bool(state.choice_of)


def place(child: RequestState, parent: RequestState, lane: AttentionLane) -> None:
    """Queue `child` at the front of `parent`'s lane, its first pass feeding only the prompt's last token."""
    child.held_by = None
    child.worker_id = parent.worker_id
    child.num_computed = len(child.prompt_ids) - 1
    child.fork_from = parent.request_id
    child.status = Status.WAITING
    lane.queue(child, 1 + child.sampling.max_tokens, front=True)


def hold(child: RequestState, parent: RequestState) -> None:
    """`child` waits for `parent`'s prompt to be in, then forks it (`take_ready`)."""
    parent.forks.append(child)
    child.held_by = parent


def take_ready(parent: RequestState) -> list[RequestState]:
    """The choices waiting on `parent`'s prompt, taken off it, once that prompt is in (else none)."""
    if not parent.forks or not prefilled(parent):
        return []
    ready, parent.forks = parent.forks, []
    return ready


def let_go(state: RequestState) -> list[RequestState]:
    """`state` is done: it stops waiting on its parent; the choices waiting on it, returned, must prefill the
    prompt themselves."""
    orphans, state.forks = state.forks, []
    for child in orphans:
        child.held_by = None
    if state.held_by is not None:
        state.held_by.forks.remove(state)
        state.held_by = None
    return orphans


def forked_later(later: Iterable[Iterable[RequestState]]) -> set[str]:
    """The parents whose KV release waits: a fork of theirs is first sent in one of the `later` microbatches of
    the iteration (`AttentionLane.take_releases` keeps them for then)."""
    return {s.fork_from for group in later for s in group if not s.first_pass_sent and s.fork_from is not None}
