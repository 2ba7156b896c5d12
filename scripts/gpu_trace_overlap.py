"""Whether a profiled step's device-to-host copies overlap its backward pass, read off a chrome trace.

Design. Pure Python over the JSON that ``torch.profiler`` exports (``export_chrome_trace``), so it
can be checked without a GPU (tests/test_gpu_check.py feeds it a hand-made trace). The trace's
complete events (``"ph": "X"``, times in microseconds, one clock for host and device) are read so:

- the backward pass on the host is the ``user_annotation`` event named ``annotation`` (the caller
  wraps ``loss.backward()`` in ``torch.profiler.record_function``);
- the copy streams are the streams that carry device-to-host copies (``gpu_memcpy`` events whose
  name says ``DtoH``): omnireduce's side stream;
- the backward pass on the device is the span of the ``kernel`` events on the other streams whose
  launch (the ``cuda_runtime``/``cuda_driver`` event with the same ``correlation``) falls inside the
  annotation; where no launch can be matched, the kernels that start inside it;
- a copy overlaps the backward pass by the part of it inside that span.

:func:`overlap_summary` gives the numbers, :func:`describe` one line for people.
"""

from __future__ import annotations

from typing import Any

LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver", "runtime", "driver")


def _copies(events: list[dict[str, Any]], direction: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("cat") == "gpu_memcpy" and direction in e.get("name", "")]


def _stream(e: dict[str, Any]) -> Any:
    return e.get("args", {}).get("stream", e.get("tid"))


def _inside(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def overlap_summary(trace: dict[str, Any], annotation: str) -> dict[str, Any]:
    """The backward pass's span on the host and the device, and how the copies fall against it."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    marks = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") == annotation]
    if not marks:
        raise ValueError(f"no user_annotation event named {annotation!r} in the trace")
    b0 = min(float(e["ts"]) for e in marks)
    b1 = max(float(e["ts"]) + float(e.get("dur", 0)) for e in marks)
    dtoh, htod = _copies(events, "DtoH"), _copies(events, "HtoD")
    copy_streams = {_stream(e) for e in dtoh}
    launches = {e["args"]["correlation"]: float(e["ts"]) for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    kernels = [e for e in events if e.get("cat") == "kernel" and _stream(e) not in copy_streams]
    matched = [k for k in kernels if k.get("args", {}).get("correlation") in launches]
    if matched:
        backward = [k for k in matched if b0 <= launches[k["args"]["correlation"]] <= b1]
    else:
        backward = [k for k in kernels if b0 <= float(k["ts"]) <= b1]
    out: dict[str, Any] = {"annotation": annotation, "backward_host_us": b1 - b0, "backward_kernels": len(backward),
                           "kernels_matched_to_launches": bool(matched), "copy_streams": sorted(map(str, copy_streams))}
    if backward:
        g0 = min(float(k["ts"]) for k in backward)
        g1 = max(float(k["ts"]) + float(k.get("dur", 0)) for k in backward)
    else:
        g0 = g1 = b1
    out["backward_device_us"] = g1 - g0
    for name, copies in (("dtoh", dtoh), ("htod", htod)):
        spans = [(float(c["ts"]), float(c["ts"]) + float(c.get("dur", 0))) for c in copies]
        out[name] = {"count": len(spans), "total_us": sum(e - s for s, e in spans),
                     "inside_backward_us": sum(_inside(s, e, g0, g1) for s, e in spans),
                     "started_before_backward_ended": sum(s < g1 for s, _ in spans)}
    out["dtoh_overlaps_backward"] = out["dtoh"]["inside_backward_us"] > 0
    return out


def describe(s: dict[str, Any]) -> str:
    """One line: the backward's device span and how much of the device-to-host copying falls inside it."""
    d = s["dtoh"]
    if not d["count"]:
        return (f"backward {s['backward_device_us'] / 1e3:.2f} ms on the device ({s['backward_kernels']} kernels); "
                "no device-to-host copy in the step")
    verdict = "they overlap the backward pass" if s["dtoh_overlaps_backward"] else "none overlaps the backward pass"
    return (f"backward {s['backward_device_us'] / 1e3:.2f} ms on the device ({s['backward_kernels']} kernels); "
            f"{d['count']} device-to-host copies, {d['started_before_backward_ended']} start before its last kernel "
            f"ends, {d['inside_backward_us'] / 1e3:.2f} of {d['total_us'] / 1e3:.2f} ms of copying inside "
            f"it: {verdict}")
