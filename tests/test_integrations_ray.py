"""Ray: probes inside two actors with different roles write to one run (local cluster on loopback)."""

from __future__ import annotations

import json
import os

import pytest

import dynascope

ray = pytest.importorskip("ray")


@ray.remote(num_cpus=0)
class _Worker:
    """A tiny training loop in an actor, probed with actor_scope."""

    def run(self, run_dir: str, role: str, rank: int | None, steps: int) -> dict:
        import torch

        from dynascope.integrations.ray import actor_scope

        torch.manual_seed(rank or 0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scope = actor_scope(run_dir, role=role, rank=rank, model=model, optimizer=opt, system_interval_s=None)
        for _ in range(steps):
            with scope.phase(role):
                loss = model(torch.randn(4, 8)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
        scope.log(final_loss=float(loss))
        scope.close()
        return {"actor_id": ray.get_runtime_context().get_actor_id(), "pid": os.getpid()}


def test_actor_scope_needs_ray_worker(tmp_path):
    from dynascope.integrations.ray import actor_scope

    assert not ray.is_initialized()  # runs before the cluster fixture below
    with pytest.raises(RuntimeError, match="running Ray worker"):
        actor_scope(tmp_path / "r", role="trainer")


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    # On a loaded box Ray's dashboard agent can start slower than the raylet waits for it (a fixed ~30 s),
    # and the node fails to start; that is Ray's start-up, not what this test checks, so try again.
    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
    for attempt in range(3):
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
                     _temp_dir=str(tmp_path_factory.mktemp("ray")))
            break
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise
    yield
    ray.shutdown()


@pytest.mark.slow
def test_two_actors_two_roles_one_run(ray_cluster, tmp_path):
    run = str(tmp_path / "async")
    trainer = _Worker.options(name="trainer-0").remote()
    rollout = _Worker.options(name="rollout-1").remote()
    got = ray.get([trainer.run.remote(run, "trainer", None, 3), rollout.run.remote(run, "rollout", None, 2)])

    with dynascope.open_store(run) as con:
        per_role = dict(((r, k), n) for r, k, n in con.sql(
            "SELECT role, rank, count(DISTINCT step) FROM tensor_stats GROUP BY ALL").fetchall())
        # ranks come from the actor names; each actor recorded its own steps
        assert per_role == {("trainer", 0): 3, ("rollout", 1): 2}
        phases = set(con.sql("SELECT role, phase FROM timings WHERE phase IN ('trainer', 'rollout')").fetchall())
        assert phases == {("trainer", "trainer"), ("rollout", "rollout")}
        events = con.sql("SELECT role, fields_json FROM events WHERE event = 'ray_actor'").fetchall()
        actor_ids = {role: json.loads(f)["actor_id"] for role, f in events}
        assert actor_ids == {"trainer": got[0]["actor_id"], "rollout": got[1]["actor_id"]}
        assert {json.loads(f)["pid"] for _, f in events} == {g["pid"] for g in got}
        assert con.sql("SELECT count(*) FROM scalars WHERE key = 'final_loss'").fetchall() == [(2,)]
        assert con.sql("SELECT count(DISTINCT run_id) FROM tensor_stats").fetchall() == [(1,)]
