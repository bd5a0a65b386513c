"""What the pip peers share (they run from this directory in a venv; ort_gqa_peer.py is copied alone into the
Debian 13 root and keeps its own copy)."""
import statistics
import time


def timed(fn, repetitions, warmup=1):
    """Calls fn `warmup` times, then `repetitions` times timed: (min, median) in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times), statistics.median(times)
