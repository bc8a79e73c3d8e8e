"""What reading vLLM's KV frames off the ZMQ socket costs the bridge, per frame, three ways.

    python -P bench/zmq_drain.py [--frames 200000] [--payload 2300]

The bridge drains its SUB socket with ``recv(NOBLOCK, copy=False)`` and ``Frame.more`` per part
(``consumers.kv_bridge.KvBridge.run``); py-spy puts that at a quarter to a third of the bridge's
samples in the flat-out ingest bench. Measured here on one PUSH/PULL pair over ipc, with frames
queued first (vLLM's three parts: topic, 8-byte seq, a ``--payload``-byte payload), by process
CPU time per frame:

* ``frames``: the bridge's way (pyzmq ``Frame`` objects, ``.more`` and ``.bytes`` per part);
* ``plain``: three ``recv()`` calls copying bytes (cheaper, but only correct if every message has
  exactly three parts: a shorter one would take the next message's parts with it; checking
  ``RCVMORE`` per part costs more than it saves);
* ``compiled``: one numba-compiled call draining up to 1,000 messages through libzmq's own
  ``zmq_msg_recv`` / ``zmq_msg_more`` (the copy pyzmq loaded, found in ``/proc/self/maps``), every
  part's bytes into one buffer with its end offset and every message's part count, so a message
  of any shape stays whole; then one ``bytes`` copy of the buffer. A candidate for the bridge,
  not used by it (bench/RESULTS.md, session 31).

Here the frames are all queued before they are read. In the live bridge they are not: session 32
wired a drain like this one into ``KvBridge.run`` (the transcoder reading its buffer in place) and
the flat-out ingest bench did not move (bridges 0.44 against 0.43 us of CPU a block, the drain
still 31% of the bridge's samples): reading while libzmq's I/O thread is still writing costs what
it costs either way. So it stays out.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import tempfile
import time

import numpy as np
import zmq


def _libzmq() -> ctypes.CDLL:
    for line in open("/proc/self/maps"):
        path = line.split()[-1]
        if "libzmq" in path and ".so" in path:
            return ctypes.CDLL(path)
    raise SystemExit("libzmq is not mapped in this process (pyzmq built against a system libzmq?)")


def compiled_drain():
    import numba
    from numba import njit

    lib = _libzmq()
    init, recv, data, more, close = lib.zmq_msg_init, lib.zmq_msg_recv, lib.zmq_msg_data, lib.zmq_msg_more, lib.zmq_msg_close
    init.argtypes, init.restype = [ctypes.c_void_p], ctypes.c_int
    recv.argtypes, recv.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int], ctypes.c_int
    data.argtypes, data.restype = [ctypes.c_void_p], ctypes.POINTER(ctypes.c_uint8)
    more.argtypes, more.restype = [ctypes.c_void_p], ctypes.c_int
    close.argtypes, close.restype = [ctypes.c_void_p], ctypes.c_int
    dontwait = int(zmq.DONTWAIT)

    @njit
    def drain(sock, msg, buf, ends, nparts, most):
        """Up to ``most`` whole messages: (messages, parts); stops before a part that does not fit."""
        mp = msg.ctypes.data
        pos = k = m = 0
        while m < most:
            init(mp)
            n = recv(mp, sock, dontwait)
            if n < 0:
                close(mp)
                break
            parts = 0
            while True:
                if pos + n > buf.shape[0] or k >= ends.shape[0]:
                    close(mp)
                    return m, k  # (a real reader would keep the part and the rest of its message)
                buf[pos:pos + n] = numba.carray(data(mp), (n,))
                pos += n
                ends[k] = pos
                k += 1
                parts += 1
                last = more(mp) == 0
                close(mp)
                if last:
                    break
                init(mp)
                n = recv(mp, sock, dontwait)
            nparts[m] = parts
            m += 1
        return m, k

    return drain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=200_000)
    ap.add_argument("--payload", type=int, default=2300, help="payload bytes (the ingest bench's frames: ~2.3 KB)")
    args = ap.parse_args()
    print(f"pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    ctx = zmq.Context()
    addr = f"ipc://{tempfile.mkdtemp()}/drain.sock"
    pub, sub = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    for s, opt in ((pub, zmq.SNDHWM), (sub, zmq.RCVHWM)):
        s.setsockopt(opt, 0)
    pub.bind(addr)
    sub.connect(addr)
    payload = b"x" * args.payload
    nb = zmq.NOBLOCK
    drain = compiled_drain()
    msg = np.zeros(64, np.uint8)  # a zmq_msg_t
    buf, ends, nparts = np.empty(4 << 20, np.uint8), np.empty(8192, np.int64), np.empty(4096, np.int64)

    def fill(n):
        for i in range(n):
            pub.send_multipart([b"kv-events", i.to_bytes(8, "big"), payload])
        while sub.poll(0) == 0:
            time.sleep(0.01)
        time.sleep(0.5)

    def frames(n):
        recv = sub.recv
        for _ in range(n):
            f = recv(nb, copy=False)
            parts = [f.bytes]
            while f.more:
                f = recv(nb, copy=False)
                parts.append(f.bytes)

    def plain(n):
        recv = sub.recv
        for _ in range(n):
            [recv(nb), recv(nb), recv(nb)]

    def compiled(n):
        got = 0
        while got < n:
            m, k = drain(sub.underlying, msg, buf, ends, nparts, min(1000, n - got))
            if not m:
                raise SystemExit("the socket ran dry early")
            buf[:ends[k - 1]].tobytes()
            got += m
        assert nparts[m - 1] == 3

    fill(10)
    drain(sub.underlying, msg, buf, ends, nparts, 10)  # (compiles)
    for rnd in range(2):
        for fn in (frames, plain, compiled):
            fill(args.frames)
            t = time.process_time()
            fn(args.frames)
            print(f"round {rnd + 1} {fn.__name__:<9} {(time.process_time() - t) / args.frames * 1e6:5.2f} us a frame")


if __name__ == "__main__":
    main()
