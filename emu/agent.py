"""Traffic agent: runs inside one emulated host and moves real TCP flows on the controller's orders.

The controller (:class:`~emu.mininet_backend.Controller`, in the driver
process) walks the workload's phase graph and tells agents which flows to
start; each agent is a dumb, fast executor:

- it listens on ``--port`` on all its addresses; every accepted connection
  carries one flow: a 17-byte header (flow id, payload bytes, TOS) and the
  payload. The receiver marks the accepted socket with the same TOS (so the
  ACKs travel in the flow's class) and, when the last byte has arrived,
  reports ``recv_done`` with its ``time.monotonic()`` stamp;
- on a ``send`` order it opens a TCP connection from the given source address
  with ``IP_TOS`` set to the flow's DSCP (and ``SO_MAX_PACING_RATE`` when the
  flow is rate-capped), sends the header and payload and reports ``send_done``.

The control channel is a ZeroMQ DEALER socket on an ``ipc://`` endpoint: Unix
sockets live in the file system, which Mininet hosts share, so control traffic
never touches the emulated links. All hosts of a Mininet run share one kernel,
hence one ``CLOCK_MONOTONIC``: stamps from different agents are comparable.

Run as ``python -m emu.agent --name nwh0 --control ipc:///tmp/x/ctl --port 7000``.
"""

from __future__ import annotations

import argparse
import socket
import struct
import threading
import time
from typing import Any

import zmq

HEADER = struct.Struct("!QQB")  # flow id, payload bytes, TOS byte
CHUNK = 1 << 20
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
_ZEROS = memoryview(bytes(CHUNK))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("connection closed inside the flow header")
        buf += part
    return bytes(buf)


class Agent:
    """One agent: a listener thread, a thread per flow, and the control socket (used from the main thread only)."""

    def __init__(self, name: str, control: str, port: int):
        self.name = name
        self.port = port
        self.ctx = zmq.Context.instance()
        self.control = self.ctx.socket(zmq.DEALER)
        self.control.setsockopt(zmq.IDENTITY, name.encode())
        self.control.setsockopt(zmq.LINGER, 1000)
        self.control.connect(control)
        # Flow threads hand their reports to the main thread through an inproc PAIR (zmq sockets are not thread-safe).
        self.reports_in = self.ctx.socket(zmq.PULL)
        self.reports_in.bind(f"inproc://reports-{name}")
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("0.0.0.0", port))
        self.listener.listen(256)

    def _report(self, msg: dict[str, Any]) -> None:
        push = self.ctx.socket(zmq.PUSH)
        push.connect(f"inproc://reports-{self.name}")
        push.send_json(msg)
        push.close(linger=1000)

    # -- receiving
    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._receive, args=(conn,), daemon=True).start()

    def _receive(self, conn: socket.socket) -> None:
        with conn:
            try:
                flow, nbytes, tos = HEADER.unpack(_recv_exact(conn, HEADER.size))
                conn.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
                t_first = None
                buf = bytearray(CHUNK)
                view = memoryview(buf)
                left = nbytes
                while left > 0:
                    got = conn.recv_into(view, min(left, CHUNK))
                    if got == 0:
                        raise ConnectionError(f"flow {flow}: connection closed with {left} bytes missing")
                    if t_first is None:
                        t_first = time.monotonic()
                    left -= got
                t_end = time.monotonic()
                self._report({"type": "recv_done", "agent": self.name, "flow": flow, "bytes": nbytes, "t_first": t_first or t_end,
                              "t_end": t_end})
            except (OSError, ConnectionError, struct.error) as exc:
                self._report({"type": "error", "agent": self.name, "error": f"receive: {exc}"})

    # -- sending
    def _send(self, order: dict[str, Any]) -> None:
        flow, nbytes, tos = int(order["flow"]), int(order["nbytes"]), int(order["tos"])
        try:
            t_start = time.monotonic()
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if order.get("pacing_bytes_per_s"):
                    s.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, int(order["pacing_bytes_per_s"]))
                if order.get("src_ip"):
                    s.bind((order["src_ip"], 0))
                s.connect((order["dst_ip"], int(order["port"])))
                s.sendall(HEADER.pack(flow, nbytes, tos))
                left = nbytes
                while left > 0:
                    n = min(left, CHUNK)
                    s.sendall(_ZEROS[:n])
                    left -= n
                t_sent = time.monotonic()
                s.shutdown(socket.SHUT_WR)
            self._report({"type": "send_done", "agent": self.name, "flow": flow, "t_start": t_start, "t_sent": t_sent})
        except OSError as exc:
            self._report({"type": "error", "agent": self.name, "error": f"send flow {flow} to {order.get('dst_ip')}: {exc}"})

    # -- main loop
    def run(self) -> None:
        threading.Thread(target=self._accept_loop, daemon=True).start()
        self.control.send_json({"type": "hello", "agent": self.name, "port": self.port, "t": time.monotonic()})
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.reports_in, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self.reports_in in events:
                self.control.send_json(self.reports_in.recv_json())
            if self.control in events:
                order = self.control.recv_json()
                kind = order.get("type")
                if kind == "send":
                    threading.Thread(target=self._send, args=(order,), daemon=True).start()
                elif kind == "ping":
                    self.control.send_json({"type": "pong", "agent": self.name, "t": time.monotonic()})
                elif kind == "stop":
                    break
        self.listener.close()
        self.control.send_json({"type": "bye", "agent": self.name})
        self.control.close(linger=1000)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="netweave traffic agent (runs inside an emulated host)")
    parser.add_argument("--name", required=True)
    parser.add_argument("--control", required=True, help="the controller's zmq endpoint (ipc://...)")
    parser.add_argument("--port", type=int, default=7000)
    args = parser.parse_args(argv)
    Agent(args.name, args.control, args.port).run()


if __name__ == "__main__":
    main()
