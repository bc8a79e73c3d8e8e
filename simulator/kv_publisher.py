"""A ZMQ publisher that speaks vLLM's KV-event wire format (``vllm/distributed/kv_events.py``).

* PUB multipart frames ``(topic, seq as 8-byte big-endian, msgpack payload)``; one frame
  per scheduler step, ``seq`` counts from 0 per engine incarnation.
* Payload: a ``KVEventBatch`` encoded as the chosen vLLM release does (``fmt``, default
  vLLM 0.33: an array batch of map events; see :data:`simulator.kv_events.WIRE_FORMATS`).
* A ROUTER replay socket: a DEALER/REQ client sends ``[b"", start_seq (8 bytes BE)]`` and
  gets ``[b"", topic, seq, payload]`` (vLLM 0.33; ``[b"", seq, payload]`` before) for every
  buffered batch with ``seq >= start_seq``, then the end marker with seq -1 (8-byte signed
  BE) and an empty payload (0.33: ``[b"", b"", ff*8, b""]``, the topic slot empty).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable

import zmq

from simulator.kv_events import (  # noqa: F401 - re-exported for users of the publisher
    DEFAULT_WIRE_FORMAT,
    MEDIUM_GPU,
    AllBlocksCleared,
    ArrayAllBlocksCleared,
    ArrayBlockRemoved,
    ArrayBlockStored,
    ArrayKVEventBatch,
    Array22BlockStored,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KvCacheEventT,
    KVEventBatch,
    block_removed,
    block_stored,
    decode_batch,
    encode_batch,
    wire_format,
)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _bindable(endpoint: str) -> str:
    """``tcp://host:0`` means "any free port": ZMQ spells that ``tcp://host:*``."""
    if endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1] == "0":
        return endpoint[: -1] + "*"
    return endpoint


class KvEventPublisher:
    """Publishes one ``KVEventBatch`` per scheduler step on a ZMQ PUB socket, keeps the last
    ``buffer_steps`` payloads and answers replay requests on an optional ROUTER socket.

    ``publish`` is synchronous (the frame is sent before it returns) and may be called from
    any one thread at a time; a small daemon thread serves the replay socket.
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:0",
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        data_parallel_rank: int = 0,
        *,
        array_like: bool = False,
        fmt: str | None = None,
        hwm: int = 100_000,
        context: zmq.Context | None = None,
    ) -> None:
        if buffer_steps <= 0:
            raise ValueError("buffer_steps must be positive")
        self._ctx = context or zmq.Context.instance()
        self._topic = topic.encode()
        self._dp_rank = data_parallel_rank
        self.fmt = wire_format(fmt if fmt is not None else ("array" if array_like else DEFAULT_WIRE_FORMAT))
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._seq = 0
        self._closed = False

        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        try:
            self._pub.bind(_bindable(endpoint))
        except zmq.ZMQError as exc:
            self._pub.close(linger=0)
            raise OSError(f"cannot bind KV-event PUB socket to {endpoint}: {exc}") from exc
        self._endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

        self._replay: zmq.Socket | None = None
        self._replay_endpoint: str | None = None
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            try:
                self._replay.bind(_bindable(replay_endpoint))
            except zmq.ZMQError as exc:
                self._replay.close(linger=0)
                self._pub.close(linger=0)
                raise OSError(f"cannot bind KV-event replay socket to {replay_endpoint}: {exc}") from exc
            self._replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve_replay, name="kv-replay", daemon=True)
            self._thread.start()

    @property
    def endpoint(self) -> str:
        """The PUB address actually bound (real port when asked for port 0)."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self._replay_endpoint

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: Iterable[KvCacheEventT], ts: float | None = None, *, drop: bool = False) -> int:
        """Send one batch (one scheduler step); returns its sequence number.

        ``drop=True`` keeps the batch for replay but does not send it: a frame lost on the
        way, so subscribers see a sequence gap (for tests of gap filling).
        """
        if self._closed:
            raise RuntimeError("KvEventPublisher is closed")
        payload = encode_batch(events, ts=time.time() if ts is None else ts,
                               data_parallel_rank=self._dp_rank, fmt=self.fmt)
        with self._lock:
            seq = self._seq
            if not drop:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
            self._buffer.append((seq, payload))
            self._seq = seq + 1
        return seq

    def reset_sequence(self) -> None:
        """Behave like a restarted engine: sequence back to 0, replay buffer emptied."""
        with self._lock:
            self._seq = 0
            self._buffer.clear()

    def _serve_replay(self) -> None:
        sock = self._replay
        assert sock is not None
        while not self._closed:
            try:
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
            except zmq.ZMQError:
                return
            if len(frames) != 3:
                continue  # malformed request: vLLM ignores it too
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            with self._lock:
                pending = [(s, p) for s, p in self._buffer if s >= start_seq]
            head = (client, b"", self._topic) if self.fmt.replay_topic else (client, b"")
            end = (client, b"", b"") if self.fmt.replay_topic else (client, b"")  # 0.33: empty topic slot
            try:
                for seq, payload in pending:
                    sock.send_multipart((*head, seq.to_bytes(8, "big"), payload))
                sock.send_multipart((*end, END_SEQ, b""))
            except zmq.ZMQError:
                if self._closed:
                    return

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._thread.join(timeout=2)
        with self._lock:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def __enter__(self) -> "KvEventPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
