"""Supervision across the pods of one replica: a rank that fails in any pod stops every pod.

A replica larger than one node is a group of pods (node ranks 0..N-1), each supervising its own
local ranks (``distributed.launch``). The pods' supervisors keep one TCP connection each to the
leader pod's supervisor (node rank 0) on ``master_port + 1``, next to torch.distributed's
rendezvous on ``master_port``. Over it they say one of three things, a JSON object per line:
``hello`` (who connects), ``failed`` (a local rank failed: the message names the pod and rank) and
``stop`` (the leader finished cleanly). The leader forwards a failure to every other pod. A
connection that closes without ``stop`` (or, towards the leader, without ``done``) is a failure
too: that pod is gone, and ranks left waiting in a collective with it would otherwise hang.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from dataclasses import dataclass

CONNECT_TIMEOUT_S = 600  # the leader pod may start (pull its image) well after a worker pod


def supervision_port(master_port: int) -> int:
    return master_port + 1


@dataclass(frozen=True)
class PodEvent:
    kind: str  # "failed" or "stop"
    message: str = ""


class PodLink:
    """This pod's end of the group's supervision channel (leader: node rank 0)."""

    def __init__(self, pod: str, node_rank: int, nnodes: int, master_addr: str, master_port: int,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S):
        self.pod, self.node_rank, self.nnodes = pod, node_rank, nnodes
        self.events: queue.Queue[PodEvent] = queue.Queue()
        self._peers: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closing = False
        port = supervision_port(master_port)
        if node_rank == 0:
            self._server = socket.create_server(("", port), reuse_port=False)
            self._server.listen(max(1, nnodes - 1))
            threading.Thread(target=self._accept, daemon=True, name="pod-link-accept").start()
        else:
            self._server = None
            sock = _connect(master_addr, port, connect_timeout_s)
            self._peers.append(sock)
            _send(sock, {"hello": pod, "nodeRank": node_rank})
            threading.Thread(target=self._read, args=(sock, "the leader pod"), daemon=True,
                             name="pod-link-leader").start()

    # ---- what the supervisor calls -----------------------------------------------------------

    def poll(self) -> PodEvent | None:
        try:
            return self.events.get_nowait()
        except queue.Empty:
            return None

    def fail(self, message: str) -> None:
        """Tell the other pods that a rank of this pod failed (the leader tells every pod)."""
        self._broadcast({"failed": message})

    def finish(self) -> None:
        """The leader's ranks are done: the other pods may end theirs. Workers say done."""
        self._broadcast({"stop": True} if self.node_rank == 0 else {"done": True})

    def close(self) -> None:
        with self._lock:
            self._closing = True
            peers, self._peers = self._peers, []
        for s in peers:
            _close(s)
        if self._server is not None:
            _close(self._server)

    # ---- inside ------------------------------------------------------------------------------

    def _broadcast(self, msg: dict, skip: socket.socket | None = None) -> None:
        with self._lock:
            peers = list(self._peers)
        for s in peers:
            if s is not skip:
                try:
                    _send(s, msg)
                except OSError:
                    pass  # that pod is gone; its reader reports it

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closing:
                    _close(sock)
                    return
                self._peers.append(sock)
            threading.Thread(target=self._read, args=(sock, None), daemon=True, name="pod-link-peer").start()

    def _read(self, sock: socket.socket, who: str | None) -> None:
        ended_cleanly = False
        try:
            for line in sock.makefile("r", encoding="utf-8"):
                msg = json.loads(line)
                if "hello" in msg:
                    who = f"pod {msg['hello']} (node rank {msg['nodeRank']})"
                elif "failed" in msg:
                    ended_cleanly = True  # the failure itself is the report
                    self.events.put(PodEvent("failed", msg["failed"]))
                    if self.node_rank == 0:
                        self._broadcast(msg, skip=sock)
                elif "stop" in msg or "done" in msg:
                    ended_cleanly = True
                    if "stop" in msg:
                        self.events.put(PodEvent("stop"))
        except (OSError, ValueError):
            pass
        with self._lock:
            closing = self._closing
        if not ended_cleanly and not closing:
            message = f"{who or 'a pod of this replica'} lost contact with {self.pod} (node rank {self.node_rank})"
            self.events.put(PodEvent("failed", message))
            if self.node_rank == 0:
                self._broadcast({"failed": message}, skip=sock)


def _send(sock: socket.socket, msg: dict) -> None:
    sock.sendall((json.dumps(msg) + "\n").encode())


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _connect(addr: str, port: int, timeout_s: float) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((addr, port), timeout=5)
            sock.settimeout(None)  # the link stays silent for as long as the replica serves
            return sock
        except OSError as exc:
            if time.monotonic() > deadline:
                raise ConnectionError(f"cannot reach the leader pod's supervisor at {addr}:{port} within "
                                      f"{timeout_s:.0f} s ({exc})") from None
            time.sleep(0.5)
