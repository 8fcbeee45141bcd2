"""A synthetic RL cluster run with planted faults: the timeline of every rank, computed before anything is written.

A synchronous GRPO job on ``ranks`` FSDP trainer ranks (``ranks_per_node`` to a host) and ``rollout_workers``
generation workers on hosts of their own. Each step:

- weight sync: the trainers broadcast the new weights to the workers (``weight_sync``, comm); it starts once
  the last trainer has finished its previous step, so its span on each trainer absorbs that rank's earliness;
- rollout: each worker generates ``samples_per_worker`` responses (``group_size`` per prompt) whose lengths are
  log-normal and capped, decoded at a fixed per-token cost; its ``rollout`` phase ends with its longest
  sample, then it scores them (``reward``) and idles (``train_wait``, wait) until the next weight sync. The
  trainers wait for the slowest worker (``rollout``, wait);
- training: ``forward`` and ``backward`` (scaled by the step's mean response length, the tokens trained on),
  then the gradient reduce-scatter (``grad_reduce``, comm), which ends when the last rank has arrived and sent
  its part, so each rank's span absorbs the lateness of others; ``optimizer``; a sharded ``checkpoint`` every
  ``checkpoint_every`` steps; and a short un-instrumented gap (logging, data).

Healthy ranks differ persistently by up to ``HEALTHY_SPREAD`` and jitter per step. Planted faults, each with
the figures a correct analysis must recover (``planted()``, written beside the run as ``planted.json``):
one rank slow in backward; one node whose ranks are all a little slow in compute and slow to send in the
reduce-scatter; one rank slow in forward on every ``intermittent_every``-th step only; one rollout worker
whose long responses decode slower (a long tail). All durations are integer µs, so each step row equals its
parts plus the gap exactly. ``dynascope.demo.synthetic_write`` writes the plan through ``RunWriter``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

T0_US = 1_760_000_000_000_000
HEALTHY_SPREAD = 0.025  # healthy ranks' persistent speed differs from 1 by at most this
MS = 1000  # µs per ms
# Base durations in ms (a 7B-class policy, long reasoning rollouts).
WEIGHT_SYNC, FORWARD, BACKWARD, COMM, OPTIMIZER, REWARD, CHECKPOINT = 1500, 4000, 8000, 800, 400, 400, 25_000
PREFILL_MS, TOKEN_MS, ADMIT_MS = 300.0, 20.0, 5.0
MEDIAN_TOKENS, SIGMA_TOKENS, MAX_TOKENS = 300.0, 0.7, 2048
# Planted faults.
SLOW_RANK_FACTOR = 1.12
SLOW_NODE_FACTORS = (1.06, 1.09)
SLOW_NODE_COMM = 1.4
INTERMITTENT_FACTOR = 1.5
TAIL_TOKENS, TAIL_FACTOR = 768, 3.0


@dataclass(frozen=True)
class ClusterSpec:
    """What to simulate. ``rollout_workers=None`` gives one worker per four trainer ranks (at least 2)."""

    ranks: int = 64
    ranks_per_node: int = 8
    rollout_workers: int | None = None
    steps: int = 500
    samples_per_worker: int = 32
    group_size: int = 8
    layers: int = 32
    hidden: int = 4096
    tensor_every: int = 10
    checkpoint_every: int = 50
    intermittent_every: int = 4
    faults: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.ranks_per_node < 1 or self.steps < 1 or self.layers < 1:
            raise ValueError("ranks, ranks_per_node, steps and layers must be >= 1")
        if self.samples_per_worker % self.group_size:
            raise ValueError("samples_per_worker must be a multiple of group_size")
        if self.workers < 1:
            raise ValueError("rollout_workers must be >= 1")

    @property
    def workers(self) -> int:
        return max(2, self.ranks // 4) if self.rollout_workers is None else self.rollout_workers

    @property
    def trainer_nodes(self) -> int:
        return math.ceil(self.ranks / self.ranks_per_node)

    def host(self, rank: int) -> str:
        """The host of a global rank: trainers fill the first nodes, rollout workers the nodes after them."""
        if rank < self.ranks:
            return f"node-{rank // self.ranks_per_node:04d}"
        return f"node-{self.trainer_nodes + (rank - self.ranks) // self.ranks_per_node:04d}"

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "rollout_workers": self.workers}


@dataclass(frozen=True)
class Faults:
    """Where the faults are planted (None: not planted at this size)."""

    slow_rank: int | None
    slow_node: int | None  # trainer node index
    intermittent_rank: int | None
    tail_worker: int | None  # rollout worker index (global rank = ranks + index)


def place_faults(spec: ClusterSpec) -> Faults:
    """Fixed places, far apart: rank 5, the middle trainer node (from 3 nodes), a rank on the last node, worker 1."""
    if not spec.faults:
        return Faults(None, None, None, None)
    nodes, rpn = spec.trainer_nodes, spec.ranks_per_node
    slow_node = nodes // 2 if nodes >= 3 else None
    intermittent = (nodes - 1) * rpn + 2 if nodes >= 2 and nodes - 1 != slow_node else 2
    slow_rank = 5 if spec.ranks > 5 else None
    if intermittent >= spec.ranks or intermittent == slow_rank:
        intermittent = None
    return Faults(slow_rank, slow_node, intermittent, 1 if spec.workers >= 2 else None)


def _us(ms: np.ndarray) -> np.ndarray:
    return np.round(ms * MS).astype(np.int64)


class ClusterPlan:
    """Every rank's phase spans and every sample, as arrays (steps × ranks, steps × workers × samples)."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.faults = place_faults(spec)
        rng = np.random.default_rng(spec.seed)
        s, r, w, n = spec.steps, spec.ranks, spec.workers, spec.samples_per_worker
        self.speed = 1 + np.clip(rng.normal(0, 0.01, r), -HEALTHY_SPREAD, HEALTHY_SPREAD)
        self.node_factor = np.ones(r)
        f = self.faults
        if f.slow_node is not None:
            lo = f.slow_node * spec.ranks_per_node
            hi = min(lo + spec.ranks_per_node, r)
            self.node_factor[lo:hi] = rng.uniform(*SLOW_NODE_FACTORS, hi - lo)
        self._samples(rng, s, w, n)
        self._timeline(rng, s, r, w)

    def _samples(self, rng: np.random.Generator, s: int, w: int, n: int) -> None:
        spec = self.spec
        tokens = rng.lognormal(math.log(MEDIAN_TOKENS), SIGMA_TOKENS, (s, w, n))
        self.response_len = np.clip(tokens, 16, MAX_TOKENS).astype(np.int64)
        groups = n // spec.group_size
        self.prompt_len = np.repeat(np.clip(rng.lognormal(math.log(180), 0.5, (s, w, groups)), 8, 2048)
                                    .astype(np.int64), spec.group_size, axis=2)
        solve = np.repeat(rng.beta(0.6, 0.6, (s, w, groups)), spec.group_size, axis=2)
        self.reward = (rng.random((s, w, n)) < solve).astype(np.float64)
        worker_speed = 1 + np.clip(rng.normal(0, 0.01, w), -HEALTHY_SPREAD, HEALTHY_SPREAD)
        decode = self.response_len.astype(np.float64)
        if self.faults.tail_worker is not None:  # long responses decode slower on this worker (preempted KV cache)
            t = self.faults.tail_worker
            extra = np.maximum(decode[:, t] - TAIL_TOKENS, 0)
            decode[:, t] += extra * (TAIL_FACTOR - 1)
        gen_ms = (PREFILL_MS + TOKEN_MS * decode) * worker_speed[None, :, None] * rng.lognormal(0, 0.03, (s, w, n))
        self.gen_us = np.round(gen_ms * MS).astype(np.int64)
        self.admit_us = (np.arange(n) * ADMIT_MS * MS).astype(np.int64)  # continuous batching admits one by one

    def _timeline(self, rng: np.random.Generator, s: int, r: int, w: int) -> None:
        spec, f = self.spec, self.faults

        def jit(*shape: int) -> np.ndarray:  # per-phase, per-step jitter
            return rng.lognormal(0, 0.015, shape)

        tokens = self.response_len.mean(axis=(1, 2))
        load = np.clip(tokens / tokens.mean(), 0.7, 1.4)[:, None]  # forward/backward scale with tokens trained
        compute = (self.speed * self.node_factor)[None, :]
        fwd = FORWARD * load * compute * jit(s, r)
        bwd = BACKWARD * load * compute * jit(s, r)
        opt = OPTIMIZER * compute * jit(s, r)
        cost = COMM * jit(s, r)
        if f.slow_rank is not None:
            bwd[:, f.slow_rank] *= SLOW_RANK_FACTOR
        if f.intermittent_rank is not None:
            hit = np.arange(s) % spec.intermittent_every == spec.intermittent_every - 1
            fwd[hit, f.intermittent_rank] *= INTERMITTENT_FACTOR
        if f.slow_node is not None:
            cost[:, self.node_factor > 1] *= SLOW_NODE_COMM
        ckpt = np.where((np.arange(s) + 1) % spec.checkpoint_every == 0, 1.0, 0.0)[:, None] * CHECKPOINT * jit(s, r)
        self.fwd_us, self.bwd_us, self.opt_us, self.ckpt_us = _us(fwd), _us(bwd), _us(opt), _us(ckpt)
        self.gap_us = _us(rng.uniform(40, 80, (s, r)))
        self.reward_us = _us(REWARD * jit(s, w))
        sync_us = _us(WEIGHT_SYNC * jit(s))
        gen_span = (self.admit_us[None, None, :] + self.gen_us).max(axis=2) + 50 * MS
        # Spans, µs since the epoch, filled step by step.
        shape_t, shape_w = (s, r), (s, w)
        self.t_start, self.t_arrive, self.t_end = (np.zeros(shape_t, np.int64) for _ in range(3))
        self.w_start, self.w_end = np.zeros(shape_w, np.int64), np.zeros(shape_w, np.int64)
        # per step: weight sync start (trainers' latest boundary) and end, rollout done, reduce-scatter end
        self.w_sync_start, self.t_sync_end, self.t_rollout_done, self.t_coll_end = (np.zeros(s, np.int64) for _ in range(4))
        prev_t, prev_w = np.full(r, T0_US, np.int64), np.full(w, T0_US, np.int64)
        for i in range(s):
            self.t_start[i], self.w_start[i] = prev_t, prev_w
            sync_start = prev_t.max()
            sync_end = sync_start + sync_us[i]
            ro_end = sync_end + gen_span[i]
            w_end = ro_end + self.reward_us[i]
            done = w_end.max()
            arrive = done + self.fwd_us[i] + self.bwd_us[i]
            coll_end = (arrive + _us(cost[i])).max()
            end = coll_end + self.opt_us[i] + self.ckpt_us[i] + self.gap_us[i]
            self.w_sync_start[i], self.t_sync_end[i], self.t_rollout_done[i] = sync_start, sync_end, done
            self.t_arrive[i], self.t_coll_end[i], self.t_end[i], self.w_end[i] = arrive, coll_end, end, w_end
            prev_t, prev_w = end, w_end
        self.gen_span_us = gen_span

    @cached_property
    def node_ranks(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for rank in range(self.spec.ranks + self.spec.workers):
            out.setdefault(self.spec.host(rank), []).append(rank)
        return out

    def planted(self) -> dict:
        """The planted faults and the figures a correct analysis recovers (JSON-ready)."""
        spec, f = self.spec, self.faults
        out: dict = {}
        if f.slow_rank is not None:
            out["slow_rank"] = {"rank": f.slow_rank, "host": spec.host(f.slow_rank), "role": "trainer",
                                "phase": "backward", "factor": SLOW_RANK_FACTOR}
        if f.slow_node is not None:
            ranks = [int(x) for x in np.flatnonzero(self.node_factor > 1)]
            out["slow_node"] = {"host": spec.host(ranks[0]), "ranks": ranks, "role": "trainer",
                                "phases": ["forward", "backward", "optimizer"],
                                "factors": {str(k): round(float(self.node_factor[k]), 4) for k in ranks},
                                "factor_range": list(SLOW_NODE_FACTORS),
                                "comm_phase": "grad_reduce", "comm_factor": SLOW_NODE_COMM}
        if f.intermittent_rank is not None:
            out["intermittent_rank"] = {"rank": f.intermittent_rank, "host": spec.host(f.intermittent_rank),
                                        "role": "trainer", "phase": "forward", "factor": INTERMITTENT_FACTOR,
                                        "every": spec.intermittent_every,
                                        "steps": f"step % {spec.intermittent_every} == {spec.intermittent_every - 1}"}
        if f.tail_worker is not None:
            rank = spec.ranks + f.tail_worker
            out["tail_worker"] = {"rank": rank, "worker": f.tail_worker, "host": spec.host(rank), "role": "rollout",
                                  "phase": "rollout", "above_tokens": TAIL_TOKENS, "decode_factor": TAIL_FACTOR}
        return {"spec": spec.as_dict(), "planted": out, "healthy_spread": HEALTHY_SPREAD,
                "hosts": self.node_ranks, "first_step_us": T0_US, "last_step_end_us": int(self.t_end[-1].max())}
