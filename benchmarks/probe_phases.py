"""Where the probe's extra step time lands: forward, backward, optimizer step and the rest, in-process A/B.

The same alternating blocks as benchmarks/probe_ab.py (plain, probed, plain, ...; ``watch()`` and
``close()`` between them; the first ``--drop`` steps of each block left out), with the reference step
timed in four parts: forward and loss, ``loss.backward()``, ``opt.step()`` (the probe's hooks run here)
and the rest (``zero_grad``, the loss read). Each probed block's medians are compared with the mean of its
two neighbours'. Time the probe adds to a part it does not run in (the forward) is what its background
threads cost the training thread: CPU and, on CPython, the GIL the training thread needs between ops.

``--pre`` runs a Python statement before the blocks, to switch one suspect off and compare, e.g.
``--pre "import dynascope.probes.tensors as T; T.tensor_stats_batch = lambda recs, meta=None: {}"`` (no
tensor_stats rows).

    python3 benchmarks/probe_phases.py --rounds 10 --block 8 --drop 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

PARTS = ("step", "forward", "backward", "optimizer", "rest")


def main() -> None:
    import probe_ab

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    probe_ab.model_args(ap)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--drop", type=int, default=2)
    ap.add_argument("--pre", default="", help="a Python statement run before the blocks")
    args = ap.parse_args()
    import torch.nn.functional as F

    import dynascope
    loop = probe_ab.Loop(args)
    exec(args.pre, {})  # noqa: S102 - the user's own switch, run as given

    def step() -> tuple[float, ...]:
        m, x, opt = loop.model, loop.x, loop.opt
        t0 = time.perf_counter()
        loss = F.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.item()
        t4 = time.perf_counter()
        return t4 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3

    def block(probed: bool) -> list[float]:
        scope = dynascope.watch(loop.model, loop.opt, run=tempfile.mkdtemp(prefix="ds-phases-")) if probed else None
        times = [step() for _ in range(args.block)][args.drop:]
        if scope is not None:
            scope.close()
        return [statistics.median(part) for part in zip(*times, strict=True)]

    for _ in range(args.warmup):
        step()
    pairs = []
    prev = block(False)
    for _ in range(args.rounds):
        probed, nxt = block(True), block(False)
        pairs.append((probed, [(a + b) / 2 for a, b in zip(prev, nxt, strict=True)]))
        prev = nxt
    print(f"{args.rounds} rounds of {args.block}-step blocks (first {args.drop} dropped); extra ms per step, "
          "median (min..max) over rounds, and the median ratio")
    for i, name in enumerate(PARTS):
        extra = [(p[i] - b[i]) * 1e3 for p, b in pairs]
        ratio = statistics.median(p[i] / b[i] for p, b in pairs)
        print(f"{name:<10} {statistics.median(extra):7.1f} ({min(extra):.1f}..{max(extra):.1f})  {ratio:.3f}x  "
              f"plain {statistics.median(b[i] for _, b in pairs) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
