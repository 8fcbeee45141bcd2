"""Discrete-event replay of measured RL step pieces under other schedules (behind ``what_if_schedule``).

Work is measured in device-µs: a piece that took ``d`` µs in the measured synchronous run, where the rank
group ran at ``rate`` devices, is ``d × rate`` device-µs of work. A *job* is a group of ``procs`` identical
processes, each able to use at most one device, on a *pool* of ``capacity`` devices that ``background``
other runnable processes also share. The pool is processor-shared, as an OS scheduler shares cores or
time-sliced GPUs share SMs: each process gets an equal share (at most one device), so a job's rate is
``procs × min(1, share)``, less what time slicing costs when processes outnumber devices (``process_share``).
Between events rates are constant, so every completion time is exact.

The processes are a trainer and ``workers`` rollout workers. The trainer publishes weight version 0, then
repeatedly takes the oldest finished batch, trains on it and publishes the next version (publishing costs
the trainer ``publish_us`` per version: serialising or broadcasting to processes of their own, which a
synchronous run, whose rollout engine shares the trainer's process, never pays). A worker loads
the newest published weights (paying the weight-sync time when its version changed), generates a batch
and hands it over; workers stop once every batch the run still needs is generated or being generated. Batches are replayed in measured order (the k-th generated batch costs the k-th
measured rollout, the k-th trained batch the k-th measured training, cycling if more are generated).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from dynascope.analyses._what_if_load import process_share

EPS = 1e-9


@dataclass
class Pool:
    capacity: float           # devices
    background: float = 0.0   # other runnable processes sharing them (each may use one device)


@dataclass(slots=True)
class _Job:
    owner: int                # 0 = trainer, 1.. = worker index + 1
    pool: int
    procs: float
    left: float               # device-µs still to do
    kind: str                 # train | publish | load | rollout
    started: float
    version: int = -1         # load/rollout: the weights it generates with
    batch: int = 0            # load/rollout: which measured rollout it replays
    rate: float = 0.0


@dataclass
class Pieces:
    """Per measured step (µs): work before the rollout, weight sync, rollout, training; samples per batch."""
    pre: np.ndarray
    sync: np.ndarray
    rollout: np.ndarray
    train: np.ndarray
    samples: np.ndarray

    def __len__(self) -> int:
        return len(self.train)

    def scaled(self, factor: float) -> Pieces:
        """The same pieces, each ``factor`` times as long (samples unchanged)."""
        return Pieces(self.pre * factor, self.sync * factor, self.rollout * factor, self.train * factor, self.samples)

    def take(self, idx: np.ndarray) -> Pieces:
        return Pieces(*(a[idx] for a in (self.pre, self.sync, self.rollout, self.train, self.samples)))


@dataclass
class Result:
    makespan_us: float
    trained: int
    samples: float
    trainer_busy_us: float
    rollout_busy_us: float            # summed over workers
    workers: int
    sync_exposed_us: float            # time the trainer sat idle while weights were being loaded
    sync_us: float = 0.0              # time workers spent loading weights
    publish_us: float = 0.0           # time the trainer spent publishing weights
    staleness: list[int] = field(default_factory=list)
    dropped: int = 0


def replay(p: Pieces, *, pools: list[Pool], trainer_pool: int, trainer_procs: float, worker_pool: int,
           worker_procs: float, workers: int, staleness: int, policy: str, rate: float,
           publish_us: float = 0.0, load_us: float | None = None, timeslice: float = 1.0) -> Result:
    """Replay ``p`` with a trainer and ``workers`` rollout workers; ``rate`` converts µs to device-µs;
    ``timeslice``: what an oversubscribed pool keeps of its capacity (``process_share``).

    ``publish_us``: what publishing a version costs each trainer process on a device of its own (0: the
    moment an update is done, weights are there); ``load_us``: what a worker's load costs on a device of
    its own, instead of the measured weight sync.

    The trainer publishes a version once an update is done (``publish_us`` later); a worker pays the weight-sync time
    when it starts a batch with a version it has not loaded yet (the copy into the inference engine, on
    the rollout side, as in the measured synchronous step). ``policy`` "block": a worker starts batch j
    only once the trainer's version is ≥ j − staleness, so no batch is staler than the bound (AReaL);
    "drop": workers never wait, and the trainer drops a batch staler than the bound when it comes to
    train on it (that generation is wasted).
    """
    n = len(p)
    pre, sync, roll, train = ((np.asarray(v, dtype=float) * rate).tolist() for v in (p.pre, p.sync, p.rollout, p.train))
    if load_us is not None:  # device-µs: each of the worker's processes on a device of its own
        sync = [load_us * worker_procs] * n
    publish = publish_us * trainer_procs
    samples = p.samples.tolist()
    res = Result(0.0, 0, 0.0, 0.0, 0.0, workers, 0.0)
    jobs: dict[int, _Job] = {}
    queue: deque[int] = deque()      # finished batches, oldest first: the weights version each was made with
    idle = list(range(workers))
    wver = [-1] * workers
    t, version, generated, trained = 0.0, -1, 0, 0

    def start(owner: int, kind: str, amount: float, v: int = -1, k: int = 0) -> None:
        pool, procs = (trainer_pool, trainer_procs) if owner == 0 else (worker_pool, worker_procs)
        jobs[owner] = _Job(owner, pool, procs, max(amount, 0.0), kind, t, v, k)

    def feed_trainer() -> None:
        nonlocal trained
        while 0 not in jobs and queue and trained < n:
            v = queue.popleft()
            if policy == "drop" and version - v > staleness:
                res.dropped += 1
                continue
            res.staleness.append(version - v)
            res.samples += samples[trained]
            nxt = trained + 1
            start(0, "train", train[trained] + (pre[nxt] if nxt < n else 0.0))
            trained = nxt

    def feed_workers() -> None:
        nonlocal generated
        for w in list(idle):
            if version < 0 or (policy == "block" and generated - version > staleness) or generated - res.dropped >= n:
                break  # no weights yet, the bound holds it back, or every batch still needed is on its way
            idle.remove(w)
            k = generated % n
            if wver[w] != version:
                start(w + 1, "load", sync[k], version, k)
                wver[w] = version
            else:
                start(w + 1, "rollout", roll[k], version, k)
            generated += 1

    start(0, "train", pre[0])  # the work before the first rollout; version 0 is published when it is done
    caps = [pl.capacity for pl in pools]
    backs = [pl.background for pl in pools]
    # (this loop runs a few times per replayed step, so it sticks to plain floats and lists)
    while jobs:
        running = list(jobs.values())
        procs = backs.copy()
        for j in running:
            procs[j.pool] += j.procs
        share = [process_share(c, q, timeslice) for c, q in zip(caps, procs, strict=True)]
        dt = float("inf")
        for j in running:
            j.rate = rate_j = j.procs * share[j.pool]
            if j.left < dt * rate_j:
                dt = j.left / rate_j
        if 0 not in jobs and any(j.kind == "load" for j in running):
            res.sync_exposed_us += dt  # the trainer waits while weights are being loaded
        elif 0 in jobs and jobs[0].kind == "publish":
            res.sync_exposed_us += dt  # the trainer's own publishing: on its critical path
        t += dt
        for j in running:
            step_work = j.rate * dt
            j.left -= step_work
            if j.left > EPS * (1.0 + step_work):
                continue
            del jobs[j.owner]  # done
            if j.kind == "load":
                res.rollout_busy_us += t - j.started
                res.sync_us += t - j.started
                jobs[j.owner] = _Job(j.owner, j.pool, j.procs, roll[j.batch], "rollout", t, j.version, j.batch)
            elif j.kind == "rollout":
                res.rollout_busy_us += t - j.started
                queue.append(j.version)
                idle.append(j.owner - 1)
            else:
                res.trainer_busy_us += t - j.started
                if j.kind == "publish":
                    res.publish_us += t - j.started
                elif publish > 0 and trained < n:  # the new weights still have to reach the workers
                    jobs[0] = _Job(0, trainer_pool, trainer_procs, publish, "publish", t)
                    continue
                version += 1
                if trained == n:  # the last batch is trained: the run is over
                    res.makespan_us, res.trained = t, trained
                    return res
        if queue and 0 not in jobs:
            feed_trainer()
        if idle and version >= 0:
            feed_workers()
    raise RuntimeError("schedule replay stalled")  # every path above ends with the last batch trained


def sequential(p: Pieces) -> Result:
    """The synchronous schedule: each step's pieces one after the other on the same devices."""
    steps = p.pre + p.sync + p.rollout + p.train
    return Result(makespan_us=float(steps.sum()), trained=len(p), samples=float(p.samples.sum()),
                  trainer_busy_us=float((p.pre + p.train).sum()), rollout_busy_us=float((p.sync + p.rollout).sum()),
                  workers=1, sync_exposed_us=float(p.sync.sum()), sync_us=float(p.sync.sum()),
                  staleness=[0] * len(p))
