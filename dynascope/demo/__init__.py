"""``dynascope demo``: a real RL post-training run on CPU (SFT → GRPO on string reversal), probed end to end.

Variants: single process (default), ``ranks > 1`` runs the whole training under torchrun/gloo data
parallel (with an optionally slowed rank), ``use_async`` runs asynchronous GRPO on a local Ray cluster.
Every process records into the same run directory; the closing report reads it back through
``dynascope.analyses``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from dynascope.core.net import free_port
from dynascope.demo.clock import Clock

__all__ = ["DEFAULT_RUN", "default_run", "run_demo"]


def _check(run_dir: Path, ranks: int, slow_rank: int | None, slow_factor: float, use_async: bool) -> None:
    if ranks < 1:
        raise ValueError("--ranks must be at least 1")
    if use_async and ranks > 1:
        raise ValueError("--async runs its own rollout and trainer actors; leave --ranks at 1")
    if slow_rank is not None and not (0 <= slow_rank < ranks):
        raise ValueError(f"--slow-rank {slow_rank} is not a rank of --ranks {ranks}")
    if slow_factor < 1:
        raise ValueError("--slow-factor must be ≥ 1 (it multiplies the slow rank's work)")
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ValueError(f"{run_dir} already exists and is not empty; pass another --run or remove it")


def _torchrun(settings_path: Path, ranks: int, console: Console) -> None:
    """The training under torchrun: one process per rank, gloo on CPU, one thread each."""
    script = Path(__file__).with_name("distributed.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script), str(settings_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    console.print(f"[dim]$ {' '.join(cmd[1:])}[/]", highlight=False)
    done = subprocess.run(cmd, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun exited with status {done.returncode} (see the rank output above)")


DEFAULT_RUN = {"tiny": "runs/demo", "smollm2": "runs/demo-smollm2"}  # each its own: both run in one checkout


def default_run(model: str = "tiny", ranks: int = 1, use_async: bool = False) -> str:
    """The run directory of a demo without ``--run``: each variant its own, so README's demos run one after
    another in one checkout (runs/demo, runs/demo-4ranks, runs/demo-async, runs/demo-smollm2)."""
    if model != "tiny":
        return DEFAULT_RUN.get(model, DEFAULT_RUN["tiny"])
    if use_async:
        return "runs/demo-async"
    return f"runs/demo-{ranks}ranks" if ranks > 1 else DEFAULT_RUN["tiny"]


def run_demo(run_dir: str | os.PathLike | None = None, quick: bool = False, ranks: int = 1, slow_rank: int | None = None,
             slow_factor: float = 2.0, long_tail: bool = False, use_async: bool = False, seed: int = 0,
             console: Console | None = None, model: str = "tiny", steps: int | None = None,
             device: str = "cpu", alerts: bool = False, spike_step: int | None = None) -> Path:
    """Train (SFT then GRPO) with dynascope's probes into ``run_dir``, then print the report; returns the run dir.

    Without ``run_dir`` each variant has its own (``default_run``), so the variants run one after another.
    Nothing is written before the options and the optional packages are checked, so a failed start
    leaves nothing that blocks its retry.

    ``model="smollm2"`` runs the real pretrained model instead (``dynascope.demo.smollm2_train``), with
    ``steps`` RL steps on ``device``. ``alerts``: the default alert rules judge the run while it trains;
    ``spike_step``: the RL step whose gradients are planted 10⁴ times too large.
    """
    from dynascope.demo.settings import DemoSettings

    console = console or Console()
    if run_dir is None:
        run_dir = default_run(model, ranks, use_async)
    if model == "smollm2":
        from dynascope.demo.smollm2_train import run_smollm2

        if quick or ranks != 1 or use_async or long_tail or alerts or spike_step is not None:
            raise ValueError("--model smollm2 runs one process: leave --quick, --ranks, --async, --long-tail, "
                             "--alerts and --spike-step out")
        return run_smollm2(run_dir, steps=steps, device=device, seed=seed, console=console)
    if model != "tiny":
        raise ValueError(f"--model {model!r}: choose tiny (the default) or smollm2")
    if steps is not None or device != "cpu":
        raise ValueError("--steps and --device apply to --model smollm2")
    run_dir = Path(run_dir).expanduser().resolve()
    _check(run_dir, ranks, slow_rank, slow_factor, use_async)
    if use_async:
        from dynascope.core.extras import check_installed

        check_installed(["ray"], "dynascope demo --async")
    s = DemoSettings.build(str(run_dir), quick=quick, ranks=ranks, slow_rank=slow_rank, slow_factor=slow_factor,
                           long_tail=long_tail, use_async=use_async, seed=seed, alerts=alerts, spike_step=spike_step)
    if spike_step is not None and (use_async or not 0 <= spike_step < s.rl.steps):
        raise ValueError(f"--spike-step must be an RL step, 0 to {s.rl.steps - 1}, of the synchronous demo")
    run_dir.mkdir(parents=True, exist_ok=True)
    settings_path = run_dir / "demo_settings.json"
    settings_path.write_text(s.to_json())
    mode = "async Ray" if use_async else (f"torchrun ×{ranks}" if ranks > 1 else "single process")
    console.print(f"[bold]dynascope demo[/] ({mode}{', quick' if quick else ''}) → {run_dir}", highlight=False)
    clock = Clock()
    if use_async:
        from dynascope.demo.async_ray import run_async

        run_async(s, console)
    elif ranks > 1:
        _torchrun(settings_path, ranks, console)
    else:
        from dynascope.demo.distributed import train_rank

        train_rank(s)
    from dynascope.demo.report import print_report

    print_report(s, console, train_s=clock.wall_s(), cpu_s=clock.cpu_s())
    return run_dir
