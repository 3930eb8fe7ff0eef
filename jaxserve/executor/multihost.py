"""Multi-host serving on jax.distributed: process 0 (the leader) schedules and serves, the other
processes (followers) run its steps.

The mesh spans every process's devices: each process holds its shard of the params and the KV
cache, and all must launch the same jitted programs in the same order (multi-controller SPMD).
The leader sends each step's inputs (the padded plan before the forward, runner.SampleInputs
before the sampler, runner.ScoreInputs before a prompt-scoring step: a few KB of numpy) to every follower over a TCP channel just before it runs
them itself; a follower runs the same programs and drops the results. The channel's address and a random token go
through jax.distributed's key-value store, so only the group's own processes can join, and the
processes agree on one KV pool size and check that their engine configs are identical before any
program runs.

Failure: a follower that disconnects (its process or host died) makes the leader fail its engine
at once (EngineDead: /ready answers 503, open streams end with the error): the watchdog sees the
connection close even while the engine idles, and a step in flight fails on its own. JAX runs
with recoverability on, so the coordination service does not abort the leader when the dead
process stops sending heartbeats; the orchestrator (e.g. a LeaderWorkerSet) restarts the group. A
follower whose leader disconnects exits with an error.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import secrets
import socket
import struct
import threading
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxserve.executor.batch_plan import BatchPlan
from jaxserve.config import DistributedConfig
from jaxserve.errors import ConfigError, EngineDead

log = logging.getLogger(__name__)

_CHANNEL_KEY = "jaxserve/step_channel"
_MAX_HEADER_BYTES = 1 << 20
_MAX_BODY_BYTES = 1 << 30
# A connection must say hello this soon: while the group forms, the leader reads one connection
# at a time, so a silent one (a port scan, a stray client) must not hold the channel for long.
_HELLO_TIMEOUT_S = 10.0
# What a step carries (BatchPlan, SamplingMetadata and bitmask fields); anything else is refused.
_DTYPES = {np.dtype(t).str for t in ("int32", "uint32", "float32")}


def initialize(dist: DistributedConfig) -> None:
    """Join the group (blocks until every process has). Must run before JAX touches a device."""
    # XLA's CPU client has no cross-process collectives unless told to use gloo.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Without it the coordination service aborts every process once one misses its heartbeats;
    # the leader must stay up to answer /ready with 503 instead.
    jax.config.update("jax_enable_recoverability", True)
    try:
        jax.distributed.initialize(dist.coordinator_address, dist.num_processes, dist.process_id)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"jax.distributed.initialize failed: {e}") from None


def group_engine_args(engine_args: dict) -> dict:
    """A group serves one model over all its devices: tensor_parallel_size defaults to, and must
    equal, the devices of every process; data parallelism is one group per replica."""
    devices = jax.device_count()
    tp = engine_args.get("tensor_parallel_size") or devices
    if tp != devices or engine_args.get("data_parallel_size", 1) != 1:
        raise ConfigError(
            f"a multi-host group of {jax.process_count()} processes serves one replica over all "
            f"{devices} devices: --tensor-parallel-size {devices} (got {tp}) and "
            f"--data-parallel-size 1 (run one group per replica)")
    return {**engine_args, "tensor_parallel_size": tp}


def _kv_store():
    # jax.distributed's key-value store has no public accessor; JAX's own compilation cache and
    # array serialization reach it the same way.
    from jax._src import distributed

    return distributed.global_state.client


def _coordinator_host() -> str:
    from jax._src import distributed

    return distributed.global_state.coordinator_address.rpartition(":")[0]


# ---- framing: (header length, body length), a JSON header, then the arrays' raw bytes ----------


def _frame(header: dict, arrays: Sequence[np.ndarray] = ()) -> bytes:
    arrays = [np.ascontiguousarray(a) for a in arrays]
    head = json.dumps({**header, "arrays": [[a.dtype.str, list(a.shape)] for a in arrays]})
    body = b"".join(a.tobytes() for a in arrays)
    return struct.pack(">II", len(head), len(body)) + head.encode() + body


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the connection closed")
        got += k
    return bytes(buf)


def _recv(sock: socket.socket, max_body: int = _MAX_BODY_BYTES) -> tuple[dict, list[np.ndarray]]:
    head_len, body_len = struct.unpack(">II", _recv_exact(sock, 8))
    if head_len > _MAX_HEADER_BYTES or body_len > max_body:
        raise ConnectionError(f"oversized frame ({head_len} + {body_len} bytes)")
    header = json.loads(_recv_exact(sock, head_len))
    body = _recv_exact(sock, body_len)
    arrays, offset = [], 0
    for dtype, shape in header.pop("arrays"):
        if dtype not in _DTYPES:
            raise ConnectionError(f"unexpected dtype {dtype!r} in a frame")
        count = math.prod(shape)
        arrays.append(np.frombuffer(body, dtype, count, offset).reshape(shape))
        offset += count * np.dtype(dtype).itemsize
    if offset != body_len:
        raise ConnectionError("a frame's arrays do not add up to its body")
    return header, arrays


def _send(sock: socket.socket, header: dict, arrays: Sequence[np.ndarray] = ()) -> None:
    sock.sendall(_frame(header, arrays))


def encode_step(inputs) -> bytes:
    """A BatchPlan (the forward's input), a runner.SampleInputs or ScoreInputs -> one frame."""
    from jaxserve.executor.runner import ScoreInputs

    if isinstance(inputs, BatchPlan):
        return _frame({"type": "forward"}, list(inputs))
    if isinstance(inputs, ScoreInputs):
        return _frame({"type": "score"}, list(inputs))
    arrays = list(inputs.metadata)
    if inputs.token_bitmask is not None:
        arrays.append(inputs.token_bitmask)
    return _frame({"type": "sample", "top_width": inputs.top_width,
                   "bitmask": inputs.token_bitmask is not None}, arrays)


def decode_step(header: dict, arrays: list[np.ndarray]):
    """A frame's BatchPlan, runner.SampleInputs or ScoreInputs."""
    from jaxserve.executor import sampler
    from jaxserve.executor.runner import SampleInputs, ScoreInputs

    if header["type"] == "forward":
        expected = len(BatchPlan._fields)
    elif header["type"] == "score":
        expected = len(ScoreInputs._fields)
    else:
        expected = len(sampler.SamplingMetadata._fields) + bool(header["bitmask"])
    if len(arrays) != expected:
        raise ConnectionError(f"a {header['type']} frame holds {len(arrays)} arrays, expected "
                              f"{expected}")
    if header["type"] == "forward":
        return BatchPlan(*arrays)
    if header["type"] == "score":
        return ScoreInputs(*arrays)
    n = len(sampler.SamplingMetadata._fields)
    return SampleInputs(sampler.SamplingMetadata(*arrays[:n]), int(header["top_width"]),
                        arrays[n] if header["bitmask"] else None)


# ---- the two ends -----------------------------------------------------------------------------


class Leader:
    """Process 0's end: waits for every follower, then publishes steps to them."""

    def __init__(self, timeout_s: float = 300.0):
        host = _coordinator_host()
        try:
            self._server = socket.create_server((host, 0))
        except OSError:  # the coordinator's name is not one of this host's addresses (a proxy)
            self._server = socket.create_server(("", 0))
        token = secrets.token_hex(16)
        port = self._server.getsockname()[1]
        _kv_store().key_value_set(_CHANNEL_KEY,
                                  json.dumps({"address": f"{host}:{port}", "token": token}))
        self.followers: dict[int, socket.socket] = {}
        self._gone = {pid: threading.Event() for pid in range(1, jax.process_count())}
        self._watched = False
        self._closing = False
        self._server.settimeout(timeout_s)
        try:
            while len(self.followers) < jax.process_count() - 1:
                sock, _ = self._server.accept()
                sock.settimeout(min(timeout_s, _HELLO_TIMEOUT_S))
                try:
                    hello, _ = _recv(sock, max_body=0)
                except (OSError, ValueError):
                    hello = {}
                pid, given = hello.get("process_id"), hello.get("token")
                ours = isinstance(given, str) and hmac.compare_digest(given.encode(),
                                                                      token.encode())
                if not ours or pid in self.followers or not (
                        isinstance(pid, int) and 0 < pid < jax.process_count()):
                    sock.close()  # not one of ours, or a duplicate
                    continue
                sock.settimeout(timeout_s)
                self.followers[pid] = sock
        except TimeoutError:
            missing = sorted(set(range(1, jax.process_count())) - set(self.followers))
            self.close()
            raise ConfigError(f"multi-host followers {missing} did not connect within "
                              f"{timeout_s:.0f} s") from None
        self._server.close()  # the group is complete: nobody else may join

    def agree_num_pages(self, num_pages: int, fingerprint: str) -> int:
        """The smallest pool any process has room for, once every config matches the leader's."""
        try:
            ready = {pid: _recv(sock)[0] for pid, sock in self.followers.items()}
        except OSError as e:
            raise ConfigError(f"a multi-host follower left during startup ({e}); see its "
                              f"log") from None
        differ = sorted(pid for pid, r in ready.items() if r.get("fingerprint") != fingerprint)
        if differ:
            message = (f"the engine config of processes {differ} differs from process 0's: every "
                       f"process must run with the same model and engine flags")
            for sock in self.followers.values():
                _send(sock, {"type": "error", "message": message})
            raise ConfigError(message)
        agreed = min([num_pages] + [int(r["num_pages"]) for r in ready.values()])
        for sock in self.followers.values():
            _send(sock, {"type": "start", "num_pages": agreed})
            sock.settimeout(None)  # from now on a step may wait for the previous one
        return agreed

    def publish(self, inputs) -> None:
        """Send a step's plan or sampler inputs to every follower (from the engine thread, before
        the leader runs them)."""
        frame = encode_step(inputs)
        for pid, sock in self.followers.items():
            try:
                sock.sendall(frame)
            except OSError as e:
                raise EngineDead(f"multi-host follower process {pid} is gone ({e}); the group "
                                 f"cannot step") from None

    def watch(self, on_lost: Callable[[EngineDead], Any]) -> None:
        """Call on_lost (once per follower) when a follower's connection closes."""
        def wait(pid: int, sock: socket.socket) -> None:
            _wait_closed(sock)
            self._gone[pid].set()
            if not self._closing:
                log.error("multi-host follower process %d disconnected", pid)
                on_lost(EngineDead(f"multi-host follower process {pid} disconnected; the group "
                                   f"cannot step until it is restarted"))

        self._watched = True
        for pid, sock in self.followers.items():
            threading.Thread(target=wait, args=(pid, sock), name=f"jaxserve-watch-{pid}",
                             daemon=True).start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Tell the followers to stop and wait until they have left jax.distributed: the leader
        hosts its coordination service, which must outlive their disconnection."""
        self._closing = True
        for pid, sock in self.followers.items():
            try:
                _send(sock, {"type": "stop"})
            except OSError:
                continue
            if not self._gone[pid].is_set():
                if self._watched:
                    self._gone[pid].wait(timeout_s)
                else:
                    sock.settimeout(timeout_s)
                    _wait_closed(sock)
        for sock in self.followers.values():
            sock.close()
        self._server.close()


def _wait_closed(sock: socket.socket) -> None:
    """Return when the peer has closed the connection (followers send nothing after startup)."""
    try:
        while sock.recv(4096):
            pass
    except OSError:
        pass


class Follower:
    """A follower's end: joins the leader's channel, then runs every step it receives."""

    def __init__(self, timeout_s: float = 300.0):
        try:
            info = json.loads(_kv_store().blocking_key_value_get(_CHANNEL_KEY,
                                                                 int(timeout_s * 1000)))
            host, _, port = info["address"].rpartition(":")
            self._sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - the KV store raises XLA's runtime errors
            raise ConfigError(f"cannot reach the multi-host leader's step channel: {e}") from None
        _send(self._sock, {"type": "hello", "process_id": jax.process_index(),
                           "token": info["token"]})

    def agree_num_pages(self, num_pages: int, fingerprint: str) -> int:
        _send(self._sock, {"type": "ready", "num_pages": num_pages, "fingerprint": fingerprint})
        reply, _ = self._recv()
        if reply["type"] == "error":
            raise ConfigError(reply["message"])
        self._sock.settimeout(None)  # steps come whenever the leader has work
        return int(reply["num_pages"])

    def _recv(self) -> tuple[dict, list[np.ndarray]]:
        try:
            return _recv(self._sock)
        except OSError as e:
            raise EngineDead(f"the multi-host leader (process 0) disconnected ({e})") from None

    def run(self, runner) -> None:
        """Run the leader's forwards and samples on `runner`, in its order, until it says stop."""
        logits = None  # of the last forward: what the next sample draws from
        while True:
            header, arrays = self._recv()
            if header["type"] == "stop":
                return
            if header["type"] == "forward":
                logits = runner.run_forward(decode_step(header, arrays))
            elif header["type"] == "sample" and logits is not None:
                runner.run_sample(logits, decode_step(header, arrays))
            elif header["type"] == "score" and logits is not None:
                runner.run_score(decode_step(header, arrays))
            else:
                raise EngineDead(f"unexpected {header['type']!r} message from the leader")

    def close(self) -> None:
        self._sock.close()
