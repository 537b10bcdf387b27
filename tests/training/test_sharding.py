"""Sharded training (FSDP, TP, TP with non-dividing heads) matches the single-device step; specs follow the rules.

Runs on the 8 simulated CPU devices of tests/conftest.py.
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from clover_jax import parallel
from clover_jax.training.trainer import Trainer
from training_helpers import ODD, TINY, SyntheticBatcher, make_cfg, tiny_base

# A large eps and no clipping keep one Adam step a smooth function of the gradient, so fp noise between
# layouts (different reduction orders) stays fp noise in the updated parameters.
CFG = ("optim.eps=1e-3", "optim.clip_value=null", "optim.warmup_steps=0", "optim.lr=1e-3", "head.num_heads=2")


def cpu_devices(n):
    devs = jax.devices("cpu")
    if len(devs) < n:
        pytest.skip(f"needs {n} CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return devs[:n]


def run_one_step(config, mesh_shape, accum=1):
    cfg = make_cfg(*CFG, f"optim.grad_accum={accum}")
    n = int(np.prod(mesh_shape))
    mesh = parallel.make_mesh(*mesh_shape, devices=cpu_devices(n))
    trainer = Trainer(cfg, tiny_base(config), base_name="tiny", mesh=mesh, donate=False)
    batch = SyntheticBatcher(vocab=config.vocab_size, batch_size=8, length=16, seed=3).batch(0)
    metrics, grads = trainer.train_step(batch, return_grads=True)
    out = jax.device_get((grads, metrics, trainer.state.params))
    return trainer, out


def assert_close(a, b, rtol, atol, what):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")


@pytest.fixture(scope="module")
def reference():
    return {"tiny": run_one_step(TINY, (1, 1, 1))[1], "odd": run_one_step(ODD, (1, 1, 1))[1]}


@pytest.mark.parametrize("name,config,mesh_shape", [
    ("fsdp", TINY, (2, 4, 1)),
    ("tp", TINY, (2, 2, 2)),
    ("tp-odd-heads", ODD, (2, 2, 2)),
])
@pytest.mark.slow  # compiles training steps on meshes
def test_sharded_step_matches_single_device(reference, name, config, mesh_shape):
    trainer, (grads, metrics, params) = run_one_step(config, mesh_shape)
    g0, m0, p0 = reference["odd" if config is ODD else "tiny"]
    np.testing.assert_allclose(metrics["loss"], m0["loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics["vloss"], m0["vloss"], rtol=1e-5)
    np.testing.assert_allclose(metrics["acc"], m0["acc"], atol=1e-6)
    scale = max(float(np.max(np.abs(x))) for x in jax.tree.leaves(g0))
    assert_close(grads, g0, rtol=1e-4, atol=1e-5 * scale, what=f"{name} grad")
    assert_close(params, p0, rtol=1e-5, atol=1e-6, what=f"{name} params after one step")
    # the parameters really are distributed
    wq = trainer.state.params["aug"]["wq"]
    assert len(wq.sharding.device_set) == int(np.prod(mesh_shape))


def test_param_shardings_follow_rules():
    mesh = parallel.make_mesh(2, 2, 2, devices=cpu_devices(8))
    trainer = Trainer(make_cfg(), tiny_base(TINY), base_name="tiny", mesh=mesh)
    spec = lambda x: x.sharding.spec  # noqa: E731
    base, head = trainer.base_state, trainer.state.params
    assert spec(base["embed"]) == P("tp", "fsdp")  # [V, D]
    assert spec(base["layers"]["wq"]) == P(None, "fsdp", "tp")  # [L, D, N, H]
    assert spec(base["layers"]["wo"]) == P(None, "tp", None, "fsdp")  # [L, N, H, D]
    assert spec(base["layers"]["w_down"]) == P(None, "tp", "fsdp")  # [L, F, D]
    assert spec(base["layers"]["attn_norm"]) == P()
    assert spec(head["aug"]["wk"]) == P(None, "fsdp", "tp")  # [L, D, K, H]
    assert spec(head["aug"]["w_gate"]) == P(None, "fsdp", "tp")
    assert spec(head["fcout_w"]) == P("fsdp", "tp")  # [2D, D]
    assert spec(head["ad1_wq"]) == P("fsdp", "tp")
    assert spec(head["head_norm"]) == P()
    adam = trainer.state.opt_state[1][0]  # chain(clip, adamw) -> adamw = (ScaleByAdamState, ...)
    assert spec(adam.mu["aug"]["wq"]) == P(None, "fsdp", "tp")
    assert spec(adam.nu["fc0_w"]) == P("fsdp", "tp")
    assert spec(adam.count) == P()


def test_non_dividing_axes_fall_back_to_replication():
    mesh = parallel.make_mesh(1, 2, 4, devices=cpu_devices(8))
    # ODD: N = K = 3 heads (tp=4 divides neither), D = 24 (fsdp=2 divides), F = 36 (tp=4 divides), V = 66
    sh = parallel.model_shardings(jax.eval_shape(lambda: tiny_base(ODD)), mesh)
    specs = parallel.describe(sh)
    assert specs["layers/wq"] == "P(None, 'fsdp')"
    assert specs["layers/wo"] == "P(None, None, None, 'fsdp')"
    assert specs["layers/w_gate"] == "P(None, 'fsdp', 'tp')"
    assert specs["embed"] == "P(None, 'fsdp')"  # 66 % 4 != 0


def test_make_mesh_errors_and_fill():
    devs = cpu_devices(8)
    mesh = parallel.make_mesh(-1, 2, 2, devices=devs)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tp": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    with pytest.raises(parallel.MeshError, match="3\\*1\\*1 = 3, but there are 8 devices"):
        parallel.make_mesh(3, 1, 1, devices=devs)
    with pytest.raises(parallel.MeshError, match="not a multiple of 3"):
        parallel.make_mesh(-1, 3, 1, devices=devs)
    assert parallel.batch_sharding(mesh).spec == P(("data", "fsdp"))
    assert parallel.replicated(mesh).spec == P()


def test_distributed_is_a_no_op_on_one_host(monkeypatch):
    for key in ("CLOVER_MULTI_HOST", "JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
                "TPU_WORKER_HOSTNAMES", "CLOUD_TPU_TASK_HOSTNAMES"):
        monkeypatch.delenv(key, raising=False)
    assert parallel.maybe_initialize_distributed("auto") is False
    assert parallel.maybe_initialize_distributed(False) is False
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert parallel._multi_host_env() == "SLURM_NTASKS"
    with pytest.raises(ValueError, match="multi_host"):
        parallel.maybe_initialize_distributed("sometimes")
