"""Multipart messages on zmq sockets with the least work per frame.

pyzmq's ``send_multipart`` / ``recv_multipart`` cost a few microseconds per frame above the socket
call itself (an ``IntFlag`` operation per frame on send, a ``getsockopt(RCVMORE)`` per frame on
receive). A tensor's round trip is a handful of messages of three to five frames each, so on the hot
path of the worker's I/O thread and the aggregator's loop the frames go one by one through
``Socket.send`` / ``Socket.recv`` with plain integer flags, and a received frame's ``more`` says
whether another follows. Frames are sent without a copy (``copy=False``: pyzmq still copies those
below its copy threshold, where that is cheaper) and received as ``zmq.Frame`` objects (no copy).
"""

from __future__ import annotations

from typing import Any

import zmq

_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)


def send_frames(sock: zmq.Socket, frames: list[Any]) -> None:
    """Send ``frames`` as one multipart message (may raise ``zmq.ZMQError`` at the first frame,
    e.g. a ROUTER's unknown peer, before anything is queued)."""
    last = len(frames) - 1
    send = sock.send
    for i, frame in enumerate(frames):
        send(frame, _SNDMORE if i < last else 0, copy=False)


def recv_frames(sock: zmq.Socket) -> list[zmq.Frame] | None:
    """The next multipart message waiting on ``sock`` (its frames, not copied), or None if none is."""
    try:
        frame = sock.recv(_NOBLOCK, copy=False)
    except zmq.Again:
        return None
    frames = [frame]
    while frame.more:  # the parts of a message arrive together: the rest is there already
        frame = sock.recv(0, copy=False)
        frames.append(frame)
    return frames

