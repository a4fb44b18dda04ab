"""The colocated pool on a Ray cluster that declares logical GPUs (the only fake: this machine has none):
the real role builders put rank `i` of the actor and of the reference, and rollout replica `i`, on GPU `i`,
no two ranks of a role share a GPU, the replicas take new weights and free their memory for training, a
tensor-parallel replica sees the devices of its bundles in order, and shutdown releases the pool."""

from __future__ import annotations

import pytest

from dapo_core.compute.cluster import NAMESPACE, Cluster, local_ray_options
from dapo_core.compute.pools import DevicePool, pool_layout
from dapo_core.config import load_config, typed
from tests.integration.conftest import CONFIG, tiny_overrides

pytestmark = pytest.mark.slow

COLOCATED = {
    "actor_rollout_ref.actor.strategy": "fsdp2",
    "trainer.n_gpus_per_node": 2,
    "trainer.use_ray": "true",
    "actor_rollout_ref.actor.use_kl_loss": "true",  # the reference group shares the GPUs too
}


@pytest.mark.timeout(600)
def test_roles_share_each_gpu_of_the_pool_and_a_tp_replica_sees_its_bundles(tiny_assets):
    import ray

    from dapo_core.compute.models import load_tokenizer
    from flows.roles import actor_worker, device_pool, ref_worker, rollout_replicas

    cfg = typed(load_config(CONFIG, tiny_overrides(tiny_assets, **COLOCATED)))
    model = str(tiny_assets / "models" / "tiny_base")
    pad = load_tokenizer(model).pad_token_id
    ray.init(num_cpus=8, num_gpus=4, include_dashboard=False, namespace=NAMESPACE, **local_ray_options())
    try:
        cluster = Cluster("colocated", device="cpu")
        cluster.pool = device_pool(cfg, cluster)
        assert cluster.pool.layout.shares == 3  # actor, ref, rollout
        assert cluster.host_options().free_cuda_cache  # each call ends by returning its cached GPU blocks
        rollout = rollout_replicas(cfg, cluster, model, "cpu")
        actor = actor_worker(cfg, cluster, model, pad, "cpu")
        ref_worker(cfg, cluster, model, pad, "cpu")
        gpus = {(w["role"], w["rank"]): w["gpus"] for w in cluster.workers if w["role"] in ("actor", "ref")}
        gpus.update({("rollout", w["rank"]): w["gpus"] for w in rollout.workers_info()})
        for rank in (0, 1):
            assert gpus[("actor", rank)] == gpus[("ref", rank)] == gpus[("rollout", rank)], gpus
            assert len(gpus[("actor", rank)]) == 1
        assert gpus[("actor", 0)] != gpus[("actor", 1)]
        actor_where = [w for w in cluster.workers if w["role"] == "actor"]
        assert rollout.colocated and rollout.push_from(actor, 1, actor_where=actor_where) == 1
        rollout.release()  # a no-op for the engine on CPU, but the call reaches every replica
        assert rollout.versions == [1, 1]
        groups = [pg.id.hex() for pg in cluster.pool.groups]
        cluster.shutdown()
        table = ray.util.placement_group_table()
        assert all(table[g]["state"] == "REMOVED" for g in groups)

        tp_pool = DevicePool.create(pool_layout(1, 4, training_roles=1, tp=2))
        devices = tp_pool.devices()
        assert sorted(devices) == ["0", "1", "2", "3"]
        assert tp_pool.visible_devices(0) == f"{devices[0]},{devices[1]}"
        assert tp_pool.visible_devices(1) == f"{devices[2]},{devices[3]}"
        tp_pool.kill()
    finally:
        ray.shutdown()
