"""The per-request decode budget: TPOT slack carried across a request's tokens.

The TPOT SLO bounds a request's *mean* time per output token, (finish - first token) / (tokens - 1), not
each step. A request whose tokens came faster than the budget has banked the difference, and one
iteration may spend it: after `d` decode tokens, the next may take

    allowance = budget × (d + 1) - (now - first token)

and the request's mean stays within the budget whenever it ends (each step keeps the invariant; no
output length is needed). An iteration serves every running request, so its clock budget is the least
allowance among them (`iteration_budget_s`). A mixed iteration whose decodes have banked slack may then
take longer than the per-step budget, at clocks nearer its energy optimum, where the step budget held a
prefill chunk beside them at a higher clock.

Every running request steps once per iteration, so `d = iteration - admitted iteration`, and the least
allowance is `budget × (iteration + 1) - now + min(first - budget × admitted)`: one heap keyed on that
term, entries of finished requests dropped lazily (the simulator's form; the live governor takes
`allowance_s` of each running request every frequency window). The budget is capped at the TTFT SLO, so
a stream never pauses longer than a user waits for a first token, and never falls below the per-step
budget.

AFlex's own (issue 38, part 5), not shared machinery: no rival's paper carries slack across a request's
tokens (BiScale's decode control picks a clock per batch within the step's TPOT, arXiv 2602.18755).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field


def allowance_s(per_token_s: float, decode_tokens: int, since_first_token_s: float) -> float:
    """How long a request's next token may take and keep its mean TPOT within `per_token_s`, after
    `decode_tokens` tokens past its first, `since_first_token_s` after that first one."""
    return per_token_s * (decode_tokens + 1) - since_first_token_s


def iteration_budget_s(step_budget_s: float, least_allowance_s: float, cap_s: float) -> float:
    """An iteration's decode budget: the running requests' least allowance, never below the per-step budget
    (the SLO margins' figure) and never above `cap_s`."""
    return max(step_budget_s, min(least_allowance_s, cap_s))


@dataclass
class DecodeSlack:
    per_token_s: float  # the TPOT budget each token is held to on average
    _heap: list[tuple[float, int]] = field(default_factory=list)  # (first token - per_token × admitted, rid)
    _live: set[int] = field(default_factory=set)

    def admit(self, rid: int, first_token_s: float, iteration: int) -> None:
        """`rid` joins the decode batch before iteration `iteration` (its first token came at `first_token_s`)."""
        self._live.add(rid)
        heapq.heappush(self._heap, (first_token_s - self.per_token_s * iteration, rid))

    def leave(self, rid: int) -> None:
        self._live.discard(rid)

    def least_allowance_s(self, now: float, iteration: int) -> float:
        """`allowance_s` least over the running requests, for the iteration numbered `iteration` (inf: none):
        with d = iteration - admitted, per_token × (d + 1) - (now - first) regrouped around the heap's key."""
        while self._heap and self._heap[0][1] not in self._live:
            heapq.heappop(self._heap)
        if not self._heap:
            return math.inf
        return self.per_token_s * (iteration + 1) - now + self._heap[0][0]

    def __len__(self) -> int:
        return len(self._live)
