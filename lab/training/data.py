"""The input pipeline: batches as a function of the step, a loader that can be slow, and prefetching.

A training step can only run once its batch is on the devices; the time the
loop spends waiting for it is *input-bound* time, invisible in a profile of
the step itself. Two knobs model a real loader:

* ``latency_s``: a fixed cost per batch (reading, decoding, tokenizing);
* ``jitter_s``: a random extra cost per batch, exponential with this mean
  (a shared file system, a slow worker, a cache miss): the long tail that
  makes throughput jump at random rather than periodically.

Prefetching (PyTorch's ``DataLoader(prefetch_factor=...)``, tf.data's
``prefetch``, grain's read-ahead) prepares the next batches in background
threads while the current step runs: once the loader's mean cost is below
the step time the wait vanishes, and the jitter is absorbed by the queue
instead of stalling the step. With ``prefetch=k``, up to k batches are made
ahead, each by its own worker, so a loader up to k times slower than the step
still keeps up. The simulated cost is a sleep (an I/O-bound loader that
releases the GIL); a CPU-bound loader would also compete with the step for cores.

Batches are a function of ``(seed, step)`` only (the lab's determinism
contract: a resumed run and every mesh see the same data), whatever the
prefetch depth and whatever order workers finish in.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from lab.errors import LabError


@dataclass(frozen=True)
class Loader:
    """Makes batch `step` as `make(step)` does, taking latency + Exp(jitter) seconds to do it."""

    make: Callable[[int], np.ndarray]
    latency_s: float = 0.0
    jitter_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.jitter_s < 0:
            raise LabError(
                f"input latency {self.latency_s * 1e3:g} ms and jitter {self.jitter_s * 1e3:g} ms must not be negative"
            )

    def cost_s(self, step: int) -> float:
        """The simulated time to load batch `step`: a function of (seed, step), like the batch."""
        jitter = np.random.default_rng([self.seed, step, 1]).exponential(self.jitter_s) if self.jitter_s else 0.0
        return self.latency_s + jitter

    def load(self, step: int) -> np.ndarray:
        cost = self.cost_s(step)
        if cost:
            time.sleep(cost)
        return self.make(step)


def batches(loader: Loader, start: int, stop: int, prefetch: int = 0) -> Iterator[np.ndarray]:
    """Batches start..stop-1 in order; with `prefetch` > 0, that many are loaded ahead by worker threads."""
    if prefetch < 0:
        raise LabError(f"--prefetch {prefetch}: use 0 (load each batch when the step needs it) or a positive depth")
    if prefetch == 0:
        yield from (loader.load(step) for step in range(start, stop))
        return
    with ThreadPoolExecutor(max_workers=prefetch, thread_name_prefix="input") as workers:
        ahead = deque(workers.submit(loader.load, step) for step in range(start, min(start + prefetch, stop)))
        for step in range(start + len(ahead), stop + len(ahead)):
            batch = ahead.popleft().result()
            if step < stop:
                ahead.append(workers.submit(loader.load, step))
            yield batch
