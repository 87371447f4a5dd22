"""When a request's generation ends: the one finish rule, applied by one process per deployment.

In the mesh the scheduler applies it (`RequestState.finish_reason_after`), to each token a worker sends
back: it owns the request's token history and ends the request (the stream, a cancellation, a recompute
elsewhere), so a second decision on the attention worker could only disagree with it. The worker's
sampler draws and counts tokens and masks EOS and stop ids under `min_tokens`, and never decides an end.
The in-process engine (`shared.engine`) has no scheduler and applies the rule itself. Pure Python (no
torch): the scheduler imports it without the model's dependencies.
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.kinds import FinishReason
from shared.model.params import SamplingParams


def stop_token_ids(params: SamplingParams, eos_token_ids: Iterable[int]) -> frozenset[int]:
    """The ids that end the request with "stop": its stop token ids, and EOS unless `ignore_eos`."""
    stop_ids = frozenset(params.stop_token_ids)
    return stop_ids if params.ignore_eos else stop_ids | frozenset(eos_token_ids)


def finish_reason(params: SamplingParams, generated_count: int, token_id: int,
                  eos_token_ids: Iterable[int], *, constrained: bool) -> FinishReason | None:
    """Why the request ends if `token_id` is its next token, `generated_count` tokens in, or None.

    Under a grammar (`constrained`) an EOS means the output is complete: "stop". Otherwise a stop id
    (`stop_token_ids`) ends it once `min_tokens` are generated, else the `max_tokens`-th token ends it
    with "length".
    """
    eos_ids = frozenset(eos_token_ids)
    if constrained and token_id in eos_ids:
        return "stop"
    if token_id in stop_token_ids(params, eos_ids) and generated_count >= params.min_tokens:
        return "stop"
    if generated_count + 1 >= params.max_tokens:
        return "length"
    return None
