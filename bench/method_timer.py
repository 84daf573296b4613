"""Wall time spent inside chosen methods of one object, e.g. the KV-cache pool's, while
a benchmark runs the code around them."""
from __future__ import annotations

import time


class MethodTimer:
    def __init__(self, obj, names):
        self.obj, self.names, self.total_ns = obj, tuple(names), 0

    def __enter__(self) -> "MethodTimer":
        clock = time.perf_counter_ns  # cheap to read, unlike the process CPU clock
        for name in self.names:
            fn = getattr(self.obj, name)

            def timed(*args, _fn=fn, **kwargs):
                t = clock()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    self.total_ns += clock() - t
            setattr(self.obj, name, timed)  # an instance attribute shadows the method
        return self

    def __exit__(self, *exc) -> None:
        for name in self.names:
            delattr(self.obj, name)
