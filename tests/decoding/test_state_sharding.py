"""How each decoding state splits over a mesh (8 simulated CPU devices, tests/conftest.py): the state of every
built-in head type's drafters (static, dynamic and beam trees, with and without a draft vocabulary, alone and under
a prompt-lookup chain with and without an n-gram table), of lookup alone, and the loops' own carries.

The expectation is the intended layout, written here in the axis alphabet (`clover_jax.axes`) and fitted to each
leaf's shape on each mesh by this file's own code: rows (B) over the batch axes, KV heads (K) and the columns of a
drafting projection (Q) over tp, a mesh axis kept only where it divides the dimension; the n-gram table replicated;
every field not named left to XLA's propagation (no sharding)."""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from clover_jax import parallel
from clover_jax.decoding.autoregressive import _ARState
from clover_jax.decoding.lookup import NoHead
from clover_jax.decoding.ngram import build_ngram_table
from clover_jax.decoding.speculative import _SpecState
from clover_jax.heads import registry
from clover_jax.heads.block.head import BlockConfig
from clover_jax.heads.eagle3.head import Eagle3Config, default_feature_layers
from clover_jax.models.cache import KVCache
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import init_llama

# 8 layers for EAGLE-3's three taps; 2 KV heads (tp=8 cannot split them, tp=2 can); a 48-token draft vocabulary
CFG = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, eos_token_ids=(2,))
VOCAB = tuple(range(0, 96, 2))
BATCH, CACHE = 8, 32
MESHES = ["data=4,tp=2", "tp=8", "data=2,fsdp=2,tp=2"]
TREES = {"TreeSpec": "chain-3", "DynamicTree": "dynamic-8-d3-k3-p0.8", "BeamTree": "beam-3x4"}

SPLIT = {"B": ("data", "fsdp"), "K": "tp", "Q": "tp"}  # the letters a mesh splits; the others stay whole
LAYOUT = {  # state type -> {field: its axes}; fields not named: no sharding
    "KVCache": {"k": "L B K S H", "v": "L B K S H", "lengths": "B"},
    "_ARState": {"tokens": "B S", "lengths": "B", "done": "B", "row_steps": "B"},
    "_SpecState": {"tokens": "B S", "lengths": "B", "done": "B", "accept_hist": "B Dmax", "node_hist": "B U",
                   "row_steps": "B"},
    "RecurrentState": {"s0": "B D"},
    "MedusaState": {"h": "B D", "heads_proj": "n D Q"},
    "ReDrafterState": {"h": "B D", "beam_proj": "I Q"},
    "BlockState": {"block_f": "B S D", "block_y": "B S", "block_count": "B"},
    "LookupState": {"history": "B S", "lengths": "B", "ngram_keys": "M", "ngram_tokens": "M"},
}


def _need_devices(n=8):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")


def fitted(axes: str, shape, mesh) -> P:
    """`axes` fitted to `shape`: each split letter's mesh axes where they divide the dim (a field of L stacked
    layers may hold L arrays, one layer each: then the leading letter is not theirs)."""
    letters = axes.split()
    if len(shape) == len(letters) - 1:
        letters = letters[1:]
    assert len(shape) == len(letters), (axes, shape)
    out = []
    for dim, letter in zip(shape, letters):
        split = SPLIT.get(letter)
        names = split if isinstance(split, tuple) else (split,)
        size = int(np.prod([mesh.shape[a] for a in names])) if split else 1
        out.append(split if split and size > 1 and dim % size == 0 else None)
    return P(*out)


def expected(tree, mesh, seen: set):
    """`tree` with each leaf replaced by the spec `LAYOUT` gives it (None: no sharding); the names of the state types
    met go into `seen`."""

    def one(node):
        layout = LAYOUT.get(type(node).__name__)
        if layout is None:
            return None
        seen.add(type(node).__name__)
        fields = {}
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if f.name in layout:
                fields[f.name] = jax.tree.map(lambda x: fitted(layout[f.name], x.shape, mesh), value)
            else:
                fields[f.name] = expected(value, mesh, seen)
        return dataclasses.replace(node, **fields)

    return jax.tree.map(one, tree, is_leaf=lambda x: type(x).__name__ in LAYOUT)


def trimmed(spec: P) -> tuple:
    """A spec without its trailing unsplit dims (`P("tp", None)` and `P("tp")` say the same)."""
    out = list(spec)
    while out and out[-1] is None:
        out.pop()
    return tuple(out)


def check(state, mesh, seen: set | None = None) -> int:
    """Asserts that `parallel.state_shardings` gives every leaf of `state` its expected spec; the number split."""
    got = parallel.state_shardings(state, mesh)
    want = expected(state, mesh, set() if seen is None else seen)
    leaf = lambda x: x is None or isinstance(x, (NamedSharding, P))  # noqa: E731
    got_flat, got_def = jax.tree_util.tree_flatten_with_path(got, is_leaf=leaf)
    want_flat, want_def = jax.tree_util.tree_flatten_with_path(want, is_leaf=leaf)
    assert got_def == want_def
    checked = 0
    for (path, g), (_, w) in zip(got_flat, want_flat):
        where = jax.tree_util.keystr(path)
        if w is None:
            assert g is None, f"{where}: {g.spec}, expected no sharding"
            continue
        assert g is not None, f"{where}: no sharding, expected {w}"
        assert g.mesh == mesh and trimmed(g.spec) == trimmed(w), f"{where}: {g.spec}, expected {w}"
        checked += 1
    return checked


@pytest.fixture(scope="module")
def base():
    return init_llama(CFG, seed=0)


@pytest.fixture(scope="module")
def heads(base):
    registry.load_all()
    out = {}
    for name in registry.BUILTIN:
        ht = registry.get(name)
        for vocab in (None, VOCAB):
            if name == "eagle3":
                cfg = Eagle3Config(feature_layers=default_feature_layers(CFG.num_hidden_layers),
                                   draft_vocab_size=0 if vocab is None else len(vocab))
            elif name == "block":
                cfg = BlockConfig(block_size=4, window=6, num_layers=1)
            else:
                cfg = ht.config_cls()
            out[name, vocab] = ht.init_from_base(base, cfg, 1)
    return out


def drafter_states(base, heads):
    """(description, state) of each drafter the registry builds for a built-in head type, plus lookup alone."""
    table = build_ngram_table([list(range(3, 40))], CFG.vocab_size, min_count=1)
    for (name, vocab), head in heads.items():
        for kind in registry.get(name).drafters:
            tree = TREES[kind.__name__]
            trees = [tree] + ([f"{tree}+lookup-3", f"{tree}+lookup-3-table"] if kind.__name__ == "TreeSpec" else [])
            for t in trees:
                drafter = registry.drafter_for(type(head), t, vocab, table)
                drafter.check(head, base)
                state = jax.eval_shape(lambda: drafter.init_state(head, base, BATCH, CACHE, drafter.arrays()))
                yield f"{name} {t} vocab={vocab is not None}", state
    for t in ("lookup-3", "lookup-3-table"):
        drafter = registry.drafter_for(NoHead, t, None, table)
        yield t, jax.eval_shape(lambda: drafter.init_state(NoHead(), base, BATCH, CACHE, drafter.arrays()))


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.slow  # builds every head type, with and without a vocabulary
def test_every_drafter_state_splits_as_its_layout_says(base, heads, mesh):
    _need_devices()
    mesh = parallel.parse_mesh(mesh)
    seen, split = set(), 0
    for what, state in drafter_states(base, heads):
        try:
            split += check(state, mesh, seen)
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None
    assert {"RecurrentState", "MedusaState", "ReDrafterState", "BlockState", "LookupState", "KVCache"} <= seen
    assert split > 0


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("per_layer", [False, True])
def test_the_loops_states_split_as_their_layout_says(mesh, per_layer):
    """The autoregressive and speculative carries, with the base's cache stacked or one array per layer, and the
    speculative carry holding a drafter's state."""
    _need_devices()
    mesh = parallel.parse_mesh(mesh)
    zeros = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    cache = jax.eval_shape(lambda: KVCache.init(CFG.num_hidden_layers, BATCH, CACHE, 2, 8, per_layer=per_layer))
    ar = _ARState(step=zeros(), tokens=zeros(BATCH, CACHE), lengths=zeros(BATCH), cache=cache, done=zeros(BATCH),
                  row_steps=zeros(BATCH), key=zeros(2))
    head_cache = jax.eval_shape(lambda: KVCache.init(1, BATCH, CACHE, 2, 8))
    spec = _SpecState(step=zeros(), tokens=zeros(BATCH, CACHE), lengths=zeros(BATCH), cache=cache,
                      head_state={"cache": head_cache, "other": zeros(BATCH, 4)}, done=zeros(BATCH),
                      accept_hist=zeros(BATCH, 4), node_hist=zeros(BATCH, 10), row_steps=zeros(BATCH), key=zeros(2))
    layers = CFG.num_hidden_layers
    assert check(ar, mesh) == 4 + (2 * layers if per_layer else 2) + 1  # the carry's rows, k and v, the lengths
    assert check(spec, mesh) > check(ar, mesh)


def test_leaves_no_state_splits_take_the_default():
    """With `default` every leaf has a sharding (abstract arguments of a program compiled ahead of time): the split
    ones as without it, the others `default`."""
    _need_devices()
    mesh = parallel.parse_mesh("data=4,tp=2")
    zeros = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    state = {"ar": _ARState(step=zeros(), tokens=zeros(BATCH, CACHE), lengths=zeros(BATCH),
                            cache=jax.eval_shape(lambda: KVCache.init(2, BATCH, CACHE, 2, 8)), done=zeros(BATCH),
                            row_steps=zeros(BATCH), key=zeros(2)),
             "loose": zeros(BATCH, 3)}
    replicated = parallel.replicated(mesh)
    plain = parallel.state_shardings(state, mesh)
    full = parallel.state_shardings(state, mesh, default=replicated)
    assert jax.tree.structure(full) == jax.tree.structure(state)
    leaf = lambda x: x is None or isinstance(x, NamedSharding)  # noqa: E731
    for p, f in zip(jax.tree.leaves(plain, is_leaf=leaf), jax.tree.leaves(full, is_leaf=leaf)):
        assert f == (replicated if p is None else p)
    assert full["loose"] == replicated and full["ar"].step == replicated
    assert full["ar"].tokens.spec == P(("data", "fsdp"))


@struct.dataclass
class _Declared:
    shard_axes: ClassVar[dict[str, str]] = {"rows": "B D"}
    rows: jax.Array


def test_a_state_that_declares_its_layout_wrongly_is_named():
    _need_devices()
    mesh = parallel.parse_mesh("data=4,tp=2")
    good = _Declared(rows=jax.ShapeDtypeStruct((BATCH, 4), jnp.float32))
    assert parallel.state_shardings(good, mesh).rows.spec == P(("data", "fsdp"))
    with pytest.raises(ValueError, match=r"_Declared.rows: declared as \[B, D\], but a leaf has shape \(8,\)"):
        parallel.state_shardings(_Declared(rows=jax.ShapeDtypeStruct((BATCH,), jnp.float32)), mesh)

    class Unknown(_Declared):
        shard_axes = {"rows": "B D", "cols": "D"}

    with pytest.raises(ValueError, match=r"Unknown.shard_axes names \['cols'\], which are not fields of Unknown"):
        parallel.state_shardings(Unknown(rows=good.rows), mesh)

    class Letters(_Declared):
        shard_axes = {"rows": "B x"}

    with pytest.raises(ValueError, match=r"Letters.rows: axes 'B x' name \['x'\], not letters of clover_jax.axes"):
        parallel.state_shardings(Letters(rows=good.rows), mesh)
