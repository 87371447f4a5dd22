"""A worker group's ranks on torch.distributed: the all-reduce of a sharded layer and the leader's commands.

One process per device. Rank 0 (the group's face on NATS) hosts a `TCPStore` and advertises it as the
group's address (`gloo://host:port`); every rank builds one gloo group over it, and an NCCL group too
when its device is a GPU (the all-reduce and the commands' tensors then go GPU to GPU). Like the seam's
pairs, the group is a `ProcessGroupGloo` of its own, not torch's default world, so a process may hold a
group and seam pairs at once.

The followers do what rank 0 tells them, in the order it tells them: rank 0 `send`s a command (a small
JSON object and its tensors) before it runs its own share of the same step, and each follower `receive`s
it and runs its share; the sharded layers' all-reduces meet because every rank issues them in the same
order. `lock` keeps rank 0's commands and their collectives from interleaving across threads.

Every collective has the group's timeout: a rank that died breaks its peers' next collective at once
(the connection closes), one that hangs breaks it after `timeout_s`, never later. Rank 0 sends a command
more often than that even when idle (services/worker_base/rank_group.py), so an idle follower's wait ends
only when rank 0 is gone.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import orjson
import torch
from torch import Tensor
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.distributed_c10d import BroadcastOptions, ProcessGroupGloo

from shared.errors import AFlexError

log = logging.getLogger("aflex.group")

JOIN_TIMEOUT_S = 600.0  # how long the ranks wait for each other to load and come (a large model's shards)
HEAD_BYTES = 1024  # a command's first message: its length and, when it fits, the whole JSON
STOP = "stop"
DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8)}


class GroupError(AFlexError):
    """The group is broken: a rank died or hung past the timeout, or the rendezvous failed."""


@dataclass
class Command:
    """What the leader tells its followers: an op, its arguments (JSON) and its tensors."""

    op: str
    args: dict[str, Any] = field(default_factory=dict)
    tensors: list[Tensor] = field(default_factory=list)


@dataclass
class Traffic:
    """What rank 0's collectives moved, by the command they served and their kind ("all-reduce", "broadcast",
    "sum"): [calls, bytes]. The simulator's per-layer charges are held to it (shared/policy/pipeline.py's
    `group_collectives`; tests/test_worker_groups.py)."""

    by_op: dict[str, dict[str, list[int]]] = field(default_factory=dict)

    def add(self, op: str, kind: str, nbytes: int) -> None:
        entry = self.by_op.setdefault(op, {}).setdefault(kind, [0, 0])
        entry[0] += 1
        entry[1] += nbytes


def store_address(host: str, port: int) -> str:
    return f"gloo://{host}:{port}"


class DeviceGroup:
    """Rank `rank` of `size` on `device`; built by `host` (rank 0) or `join` (the others)."""

    def __init__(self, store: Any, rank: int, size: int, device: torch.device, timeout_s: float, address: str,
                 host: str = "127.0.0.1", join_timeout_s: float = JOIN_TIMEOUT_S) -> None:
        self.rank, self.size, self.device, self.timeout_s, self.address = rank, size, device, timeout_s, address
        self._store = store  # rank 0's keeps the server alive
        self.lock = threading.RLock()
        timeout = timedelta(seconds=timeout_s)
        try:  # every rank has loaded its share and come (as long as loading takes), then the group connects
            _meet(store, "aflex/group/ready", rank, size, join_timeout_s)
        except Exception as exc:
            raise GroupError(f"rank {rank} of {size}: the other ranks did not come to {address} within "
                             f"{join_timeout_s:g} s: {exc}") from None
        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = timeout
        try:
            self.gloo: Any = ProcessGroupGloo(PrefixStore("aflex/group/gloo", store), rank, size, options)
            self.nccl: Any = None
            if device.type == "cuda":
                from torch.distributed.distributed_c10d import ProcessGroupNCCL

                nccl_options = ProcessGroupNCCL.Options()
                nccl_options._timeout = timeout
                torch.cuda.set_device(device)
                self.nccl = ProcessGroupNCCL(PrefixStore("aflex/group/nccl", store), rank, size, nccl_options)
        except Exception as exc:
            raise GroupError(f"rank {rank} of {size} could not form the group at {address}: {exc}") from None
        self.broken = False
        self.traffic = Traffic()
        self.op = ""  # the command the collectives serve (rank 0: the last one it sent)

    # -- forming ----------------------------------------------------------------------------------

    @staticmethod
    def open_store(port: int = 0, advertise: str = "127.0.0.1", join_timeout_s: float = JOIN_TIMEOUT_S
                   ) -> tuple[Any, str]:
        """Rank 0's rendezvous store on `port` (0: a free one), and the address the other ranks join at."""
        store = TCPStore("0.0.0.0", port, world_size=None, is_master=True, timeout=timedelta(seconds=join_timeout_s),
                         wait_for_workers=False)
        return store, store_address(advertise, store.port)

    @classmethod
    def join(cls, address: str, rank: int, size: int, device: torch.device, timeout_s: float,
             join_timeout_s: float = JOIN_TIMEOUT_S) -> DeviceGroup:
        """A follower's side of the rendezvous (blocks until every rank has come)."""
        url = urlsplit(address)
        if url.scheme != "gloo" or not url.hostname or not url.port:
            raise GroupError(f"not a group address: {address!r}")
        try:
            store = TCPStore(url.hostname, url.port, world_size=None, is_master=False,
                             timeout=timedelta(seconds=join_timeout_s), wait_for_workers=False)
        except Exception as exc:
            raise GroupError(f"rank {rank}: cannot reach the group's store at {address}: {exc}") from None
        return cls(store, rank, size, device, timeout_s, address, host=_host_towards(url.hostname),
                   join_timeout_s=join_timeout_s)

    def barrier(self, tag: str, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Every rank has reached `tag` (a fresh one each time), however long that takes up to `timeout_s`: for
        steps as slow as loading the weights again, which the collectives' timeout would cut short."""
        try:
            _meet(self._store, f"aflex/group/barrier/{tag}", self.rank, self.size, timeout_s)
        except Exception as exc:
            self.broken = True
            raise GroupError(f"group {self.address}: the ranks did not all reach {tag!r}: {exc}") from None

    # -- collectives ------------------------------------------------------------------------------

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum of every rank's `x`, in place (NCCL for a GPU tensor, else gloo)."""
        group = self.nccl if x.is_cuda and self.nccl is not None else self.gloo
        self._wait(group.allreduce([x]), "all-reduce")
        self.traffic.add(self.op, "all-reduce", x.numel() * x.element_size())
        return x

    def sum_float(self, value: float) -> float:
        """The sum over the ranks of one number (e.g. each device's energy of one step)."""
        return self.sum_floats([value])[0]

    def sum_floats(self, values: list[float]) -> list[float]:
        """The sums over the ranks of a few numbers, in one collective."""
        t = torch.tensor(values, dtype=torch.float64)
        self._wait(self.gloo.allreduce([t]), "sum")
        self.traffic.add(self.op, "sum", t.numel() * t.element_size())
        return [float(v) for v in t]

    def _broadcast(self, x: Tensor) -> Tensor:
        group = self.nccl if x.is_cuda and self.nccl is not None else self.gloo
        options = BroadcastOptions()
        options.rootRank = 0
        self._wait(group.broadcast([x], options), "broadcast")
        self.traffic.add(self.op, "broadcast", x.numel() * x.element_size())
        return x

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait()
        except Exception as exc:  # a peer closed its connection, or the timeout passed
            self.broken = True
            raise GroupError(f"group {self.address}: {what} failed on rank {self.rank}: {exc}") from None

    # -- commands ---------------------------------------------------------------------------------

    def send(self, op: str, tensors: list[Tensor] | None = None, **args: Any) -> None:
        """Rank 0: tell the followers to do `op` (call with `lock` held, and run rank 0's share next)."""
        tensors = tensors or []
        self.op = op
        body = orjson.dumps({"op": op, "args": args,
                             "tensors": [[list(t.shape), str(t.dtype), t.is_cuda] for t in tensors]})
        head = torch.zeros(HEAD_BYTES, dtype=torch.uint8)
        head[:4] = torch.frombuffer(bytearray(struct.pack("<I", len(body))), dtype=torch.uint8)
        inline = body[:HEAD_BYTES - 4]
        head[4:4 + len(inline)] = torch.frombuffer(bytearray(inline), dtype=torch.uint8)
        self._broadcast(head)
        if len(body) > len(inline):
            self._broadcast(torch.frombuffer(bytearray(body[len(inline):]), dtype=torch.uint8))
        for t in tensors:
            self._broadcast(t.contiguous())

    @contextlib.contextmanager
    def step(self, op: str, tensors: list[Tensor] | None = None, **args: Any) -> Iterator[None]:
        """Rank 0: send `op`, then run rank 0's share of it in the block, no other command in between."""
        with self.lock:
            self.send(op, tensors, **args)
            yield

    def receive(self) -> Command:
        """A follower: the leader's next command, its tensors on this rank's device."""
        head = self._broadcast(torch.zeros(HEAD_BYTES, dtype=torch.uint8))
        (length,) = struct.unpack("<I", head[:4].numpy().tobytes())
        body = head[4:4 + min(length, HEAD_BYTES - 4)].numpy().tobytes()
        if length > len(body):
            body += self._broadcast(torch.zeros(length - len(body), dtype=torch.uint8)).numpy().tobytes()
        message = orjson.loads(body)
        self.op = message["op"]
        tensors = []
        for shape, dtype, on_gpu in message["tensors"]:
            on = self.device if on_gpu and self.nccl is not None else torch.device("cpu")
            tensors.append(self._broadcast(torch.empty(shape, dtype=DTYPES[dtype], device=on)))
        return Command(message["op"], message["args"], tensors)

    def close(self) -> None:
        """Rank 0 tells the followers to exit (best effort: a broken group has nobody to tell)."""
        if self.rank == 0 and not self.broken:
            with self.lock:
                try:
                    self.send(STOP)
                except GroupError as exc:
                    log.info("group %s: could not stop the followers: %s", self.address, exc)


def _meet(store: Any, prefix: str, rank: int, size: int, timeout_s: float) -> None:
    """Say this rank is at `prefix` in the store and wait until all `size` ranks are (store errors raise)."""
    store.set(f"{prefix}/{rank}", "1")
    store.wait([f"{prefix}/{r}" for r in range(size)], timedelta(seconds=timeout_s))


def leading(group: DeviceGroup | None, op: str, tensors: list[Tensor] | None = None, **args: Any
            ) -> contextlib.AbstractContextManager[None]:
    """`group.step(...)` on rank 0 of a group; nothing to tell for a worker of one device."""
    return contextlib.nullcontext() if group is None else group.step(op, tensors, **args)


def _host_towards(host: str) -> str:
    """This machine's address on the route to `host` (the interface gloo binds)."""
    from shared.transport.torch_seam import local_host_towards

    return local_host_towards(f"tcp://{host}")
