"""Every decoding loop lowers for TPUs and NVIDIA GPUs on any machine: `jax.export` with `platforms=("tpu",
"cuda")` traces and lowers the autoregressive and speculative loops of a tiny model here, on a CPU, so a loop that
a TPU or GPU cannot lower (an op, a dtype, a sharding XLA has only for one backend) fails in CI without one.

The loops are exported as the product builds them for each target: on a TPU the base model's layers and the draft
head's run scanned (`decode_layers`, `head_layers`), on a GPU unrolled; with a mesh, scanned and sharded. A loop
exported for the CPU too runs here and decodes what the jitted loop decodes. Streaming loops are not exported: their
host callback has no serialized form (`jax.export` refuses it), and they run on one device only.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export

from clover_jax import parallel
from clover_jax.decoding import autoregressive, speculative
from clover_jax.decoding.lookup import NoHead
from clover_jax.decoding.sampling import SamplingParams
from clover_jax.heads import registry
from clover_jax.models.llama import init_llama
from tiny_llama import TINY_LLAMA

TARGETS = ("tpu", "cuda")
# the layers each target's loops run (`decode_layers` / `head_layers` on that backend, one device, float32)
LAYERS = {"tpu": "scan", "cuda": "unrolled"}
CACHE = 256
B, T = 2, 32


@pytest.fixture(scope="module")
def base():
    return init_llama(TINY_LLAMA, seed=0)


def _inputs(mesh=None):
    prompt = np.zeros((B, T), np.int32)
    prompt[0, :5], prompt[1, :9] = [5, 9, 11, 3, 7], [4, 8, 15, 16, 23, 42, 7, 7, 9]
    return autoregressive.row_inputs(prompt, np.array([5, 9], np.int32), 8, mesh)


def _sampling(greedy):
    return SamplingParams() if greedy else SamplingParams(temperature=0.7, top_k=20, top_p=0.9)


def _export_ar(base, layers, greedy, platforms=TARGETS, mesh=None):
    graph, state = nnx.split(base)
    fn = autoregressive._jitted(graph, CACHE, greedy, jnp.dtype(base.dtype), mesh, layers,
                                autoregressive.products_precision(base.dtype), False)
    args = (parallel.place(state, mesh), *_inputs(mesh), jnp.asarray([2], jnp.int32), _sampling(greedy).arrays(),
            jax.random.key(0))
    return export.export(fn, platforms=platforms)(*args), fn, args


def _head(base, head_type):
    if head_type is None:
        return NoHead()
    ht = registry.get(head_type)
    return ht.init_from_base(base, ht.config_cls())


def _export_spec(base, head, tree, layers, greedy, platforms=TARGETS, mesh=None, monkeypatch=None):
    drafter = registry.drafter_for(type(head), tree)
    loop = speculative.SpeculativeLoop(drafter=drafter, cache_size=CACHE, greedy=greedy,
                                       cache_dtype=jnp.dtype(base.dtype), mesh=mesh, layers=layers,
                                       precision=autoregressive.products_precision(base.dtype))
    if monkeypatch is not None:  # the head's own layers as the target runs them (`head_layers` reads the backend)
        monkeypatch.setattr(speculative, "head_layers", lambda mesh=None: "scan" if mesh is not None else layers)
    (base_graph, base_state), (head_graph, head_params) = nnx.split(base), nnx.split(head)
    fn = loop.compiled(base_graph, head_graph)
    args = (parallel.place(base_state, mesh), parallel.place(head_params, mesh), drafter.arrays(), *_inputs(mesh),
            jnp.asarray([2], jnp.int32), _sampling(greedy).arrays(), jax.random.key(0))
    return export.export(fn, platforms=platforms)(*args), fn, args


def _check(exp, platforms=TARGETS):
    assert exp.platforms == platforms
    assert "stablehlo.while" in exp.mlir_module()  # the decoding loop, lowered


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("target", TARGETS)
def test_autoregressive_loop_lowers_for_tpu_and_cuda(base, target, greedy):
    exp, _, _ = _export_ar(base, LAYERS[target], greedy)
    _check(exp)


@pytest.mark.parametrize("head_type,tree", [
    ("clover2", "chain-4"),  # a static tree
    pytest.param("clover2", "dynamic-10", marks=pytest.mark.slow),  # a tree chosen per step and row
    pytest.param("redrafter", "beam-2x3", marks=pytest.mark.slow),  # beam search merged into a tree
    (None, "lookup-4"),  # head-less prompt lookup
])
@pytest.mark.parametrize("target", TARGETS)
def test_speculative_loop_lowers_for_tpu_and_cuda(base, head_type, tree, target, monkeypatch):
    exp, _, _ = _export_spec(base, _head(base, head_type), tree, LAYERS[target], True, monkeypatch=monkeypatch)
    _check(exp)


def test_lossless_sampling_lowers_for_tpu_and_cuda(base, monkeypatch):
    exp, _, _ = _export_spec(base, _head(base, "clover2"), "dynamic-10", "scan", False, monkeypatch=monkeypatch)
    _check(exp)


def test_loops_on_a_mesh_lower_for_tpu_and_cuda(base):
    """Rows over `data`, heads and the MLP over `tp`: the sharded loops of a TPU slice, on 8 simulated devices."""
    mesh = parallel.parse_mesh("data=2,tp=4")
    exp, _, _ = _export_ar(base, "scan", True, mesh=mesh)
    _check(exp)
    assert exp.nr_devices == 8
    exp, _, _ = _export_spec(base, _head(base, "clover2"), "chain-4", "scan", True, mesh=mesh)
    _check(exp)
    assert exp.nr_devices == 8


@pytest.mark.slow  # exports, then runs, a loop
def test_the_exported_loop_decodes_what_the_jitted_loop_decodes(base):
    """Exported for the CPU beside the two targets, the program runs here: the same tokens as the jitted loop."""
    exp, fn, args = _export_ar(base, "scan", True, platforms=("cpu",) + TARGETS)
    got, want = exp.call(*args), fn(*args)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    assert int(np.asarray(got.num_generated).min()) >= 1
