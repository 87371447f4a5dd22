"""When a `Generation` resubmits its request (`_lost`): its scheduler run is gone, a NATS connection came
back, a delta index has stayed missing while later ones came, or a live scheduler has been quiet long."""

from __future__ import annotations

import time
from typing import Any, cast

from services.gateway import generation
from services.gateway.generation import QUIET, Generation
from shared.messages import OutputDelta, SamplingSpec


class Watch:
    """A `SchedulerWatch` whose answers the test sets."""

    watching = True

    def __init__(self) -> None:
        self.epoch, self.silence_s = 0, 0.0

    def silent_s(self, instance: str) -> float:
        return self.silence_s

    def loss_epoch(self, instance: str) -> int:
        return self.epoch


def test_each_reason_to_resubmit() -> None:
    watch = Watch()
    g = Generation(nc=cast(Any, None), request_id="r1", model_id="m", prompt_ids=[1], sampling=SamplingSpec(),
                   stop=(), tokenizer=cast(Any, None), submit_timeout_s=1.0, token_timeout_s=60.0,
                   watch=cast(Any, watch))
    now = time.monotonic()
    g._instance, g._heard_mono, g._synced_epoch = "run-1", now, 0
    assert g._lost() is None  # all quiet, nothing missing
    watch.epoch = 1
    assert g._lost() == "a NATS connection came back: deltas may be lost"
    watch.epoch = 0
    g._next_index, g._pending = 4, {5: OutputDelta(request_id="r1", index=5, token_ids=[7])}
    assert g._lost() is None  # a gap just opened: give the delta a moment
    assert g._gap_since is not None
    g._gap_since -= generation.GAP_WAIT_S
    assert g._lost() == "delta 4 is missing, later ones came"
    g._pending[4] = OutputDelta(request_id="r1", index=4, token_ids=[6])
    assert g._lost() is None  # it came
    g._pending = {}
    g._heard_mono = now - generation.QUIET_RESYNC_S
    assert g._lost() == QUIET
    watch.silence_s = g.scheduler_silence_s
    assert g._lost() == "scheduler run-1 is gone"
