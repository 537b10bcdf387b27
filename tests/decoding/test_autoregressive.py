"""Autoregressive generation: batching, stopping, sampling and compilation behaviour."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
import pytest

from clover_jax import generate
from clover_jax.decoding import autoregressive, memory
from clover_jax.decoding.sampling import argmax_last, sample_with_uniform, warp_probs
from clover_jax.models.llama import init_llama
from tiny_llama import TINY_LLAMA

CFG = TINY_LLAMA


@pytest.fixture(scope="module")
def tiny():
    return init_llama(CFG, seed=0)


def test_argmax_last_is_jnp_argmax():
    """Greedy decoding and greedy verification take `argmax_last` (two plain reductions, faster on XLA:CPU): the
    index of `jnp.argmax` on logits of every shape the loops use, ties to the first index, all -inf rows, and
    bfloat16; a row holding a NaN gives a NaN's index or the maximum's, never an index out of the vocabulary."""
    f = jax.jit(argmax_last)
    rng = np.random.default_rng(0)
    for shape in [(1, 1), (3, 7), (2, 9, 49152), (4, 1, 300)]:
        x = rng.standard_normal(shape).astype(np.float32)
        x[..., shape[-1] // 2] = x.max(-1)  # a tie: the first index wins
        x[0, ...] = -np.inf
        for dt in (jnp.float32, jnp.bfloat16):
            y = jnp.asarray(x, dt)
            np.testing.assert_array_equal(np.asarray(f(y)), np.asarray(jnp.argmax(y, -1)))
            assert f(y).dtype == jnp.int32
    x = rng.standard_normal((3, 50)).astype(np.float32)
    x[0, 40] = np.nan
    x[1, 3] = np.nan
    got = np.asarray(f(jnp.asarray(x)))
    assert got[0] in (40, int(np.nanargmax(x[0]))) and got[1] in (3, int(np.nanargmax(x[1])))
    assert got[2] == int(np.argmax(x[2]))


def _prompts(n, rng=np.random.RandomState(0)):
    return [rng.randint(3, 64, rng.randint(2, 20)).tolist() for _ in range(n)]


def _naive_greedy(model, prompt, n):
    """Up to `n` greedy tokens, each from a full forward over everything so far (no cache), stopping at EOS."""
    ids = list(prompt)
    for _ in range(n):
        logits, *_ = model(np.asarray([ids]))
        ids.append(int(np.argmax(np.asarray(logits[0, -1]))))
        if ids[-1] == 2:
            break
    return ids[len(prompt):]


@pytest.mark.slow  # a loop per prompt
def test_batch_equals_each_prompt_alone(tiny):
    prompts = _prompts(4)
    batch = generate(tiny, prompts, max_new_tokens=12, cache_size=64)
    for i, p in enumerate(prompts):
        alone = generate(tiny, [p], max_new_tokens=12, cache_size=64)
        assert batch.token_ids[i] == alone.token_ids[0]


@pytest.mark.slow  # compiles the loop and a step-by-step reference
def test_greedy_matches_naive_argmax_loop(tiny):
    p = _prompts(1)[0]
    out = generate(tiny, [p], max_new_tokens=10, cache_size=64).token_ids[0]
    assert out == _naive_greedy(tiny, p, len(out))


@pytest.mark.slow  # long prompts, a loop per block size
def test_prefill_in_blocks_equals_one_block(tiny):
    """A prompt longer than the block runs block by block against the cache: the last logits, the hidden states
    and the cached keys/values of every row's valid positions equal the one-block pass (to float rounding), the
    cache lengths exactly; rows shorter than the longest (one block, several, one token) are unaffected."""
    from clover_jax.models.cache import KVCache

    rng = np.random.RandomState(3)
    lens = np.array([37, 9, 64, 1], np.int32)
    prompt = np.zeros((4, 64), np.int32)
    for r, n in enumerate(lens):
        prompt[r, :n] = rng.randint(3, 64, n)

    def run(chunk, size):
        cache = KVCache.init(CFG.num_hidden_layers, 4, size, CFG.num_key_value_heads, CFG.head_dim)
        return jax.jit(lambda p, l: autoregressive.prefill(tiny, p, l, cache, chunk=chunk))(prompt, lens)

    one_logits, one_hidden, one_cache = run(64, 256)
    for chunk, size in [(8, 256), (16, 256), (16, 100)]:  # cache a multiple of CACHE_BLOCK (blocked reads), or not
        logits, hidden, cache = run(chunk, size)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(one_logits), atol=2e-5)
        assert np.asarray(cache.lengths).tolist() == lens.tolist()
        for r, n in enumerate(lens):
            np.testing.assert_allclose(np.asarray(hidden[r, :n]), np.asarray(one_hidden[r, :n]), atol=2e-5)
            np.testing.assert_allclose(np.asarray(cache.k[:, r, :, :n]), np.asarray(one_cache.k[:, r, :, :n]),
                                       atol=2e-5)
            np.testing.assert_allclose(np.asarray(cache.v[:, r, :, :n]), np.asarray(one_cache.v[:, r, :, :n]),
                                       atol=2e-5)


@pytest.mark.slow  # compiles the loop twice (scan and unrolled layers)
def test_unrolled_layers_equal_the_scan(tiny):
    """`layers="unrolled"` (one buffer per layer, a per-layer KV cache) and `layers="scan"` (stacked weights and
    cache) decode the same greedy tokens, with short prompts and one prefilled in blocks, and sample the same
    tokens with the same key."""
    from clover_jax.decoding.sampling import SamplingParams

    long = np.random.RandomState(7).randint(3, 64, autoregressive.PREFILL_CHUNK + 30).tolist()
    prompts = _prompts(3) + [long]
    n = max(len(p) for p in prompts)
    prompt = np.zeros((len(prompts), n), np.int32)
    for r, p in enumerate(prompts):
        prompt[r, :len(p)] = p
    lens = np.array([len(p) for p in prompts], np.int32)
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0)):
        out = {layers: autoregressive.ar_generate(tiny, prompt, lens, max_new_tokens=12, cache_size=n + 16,
                                                  sampling=sampling, key=jax.random.key(3), layers=layers)
               for layers in ("scan", "unrolled")}
        np.testing.assert_array_equal(np.asarray(out["scan"].tokens), np.asarray(out["unrolled"].tokens))
        np.testing.assert_array_equal(np.asarray(out["scan"].lengths), np.asarray(out["unrolled"].lengths))


def test_decode_layers_policy(tiny, monkeypatch):
    """`auto` unrolls one-token float32 loops on a CPU and every loop on a GPU, without a mesh; it scans
    meshes, TPUs, a CPU's multi-token and bf16 loops, and, where the loop cannot read slices of the stacked weights
    in place, when its copy of the layer weights would not fit twice in free memory; `generate(layers=...)`
    overrides it; bad values are refused."""
    from clover_jax import validation

    assert autoregressive.decode_layers(None, model=tiny) == "unrolled"
    assert autoregressive.decode_layers("auto", tokens_per_step=4, model=tiny) == "scan"
    assert autoregressive.decode_layers("unrolled", tokens_per_step=4) == "unrolled"
    assert autoregressive.decode_layers("auto", mesh=object()) == "scan"
    with pytest.raises(ValueError, match="not supported with a mesh"):
        autoregressive.decode_layers("unrolled", mesh=object())
    with pytest.raises(ValueError, match="layers must be one of"):
        autoregressive.decode_layers("unroll")
    bf16 = init_llama(CFG, seed=0, dtype=jnp.bfloat16)
    assert autoregressive.decode_layers(None, model=bf16) == "scan"
    assert autoregressive.decode_layers(None, tokens_per_step=4, model=bf16) == "scan"
    from clover_jax import prepare_generate

    # the GPU rule (see decode_layers): every loop unrolled, bf16 and multi-token ones too; a TPU scans
    monkeypatch.setattr(autoregressive.jax, "default_backend", lambda: "gpu")
    for model in (tiny, bf16):
        assert autoregressive.decode_layers(None, tokens_per_step=4, model=model) == "unrolled"
        assert autoregressive.decode_layers(None, model=model) == "unrolled"
    assert autoregressive.decode_layers(None, mesh=object(), model=bf16) == "scan"
    assert prepare_generate(bf16, _prompts(2), max_new_tokens=4, cache_size=64).layers == "unrolled"
    assert prepare_generate(bf16, _prompts(2), max_new_tokens=4, cache_size=64, layers="scan").layers == "scan"
    monkeypatch.setattr(autoregressive.jax, "default_backend", lambda: "tpu")
    assert autoregressive.decode_layers(None, model=tiny) == "scan"
    monkeypatch.undo()
    small = autoregressive.layer_weight_bytes(tiny)
    assert small == sum(x.nbytes for x in jax.tree.leaves(tiny.layers.layer_params())) > 0

    # on a CPU the unrolled loop reads slices of the stacked weights in place: no copy to plan or to fit
    assert autoregressive.layer_copy_bytes(tiny, "unrolled") == 0
    plan = prepare_generate(tiny, _prompts(2), max_new_tokens=4, cache_size=64)
    assert plan.layers == "unrolled" and "per-layer copy of the layer weights" not in plan.memory
    monkeypatch.setattr(memory, "available_memory", lambda device=None: (0, "test"))
    assert autoregressive.decode_layers(None, model=tiny) == "unrolled"
    # a backend that cannot alias them: the program slices, the copy is planned and must fit twice
    monkeypatch.setattr(type(tiny.layers), "layer_views", lambda self: None)
    assert autoregressive.layer_copy_bytes(tiny, "unrolled") == small
    assert autoregressive.layer_copy_bytes(tiny, "scan") == 0
    monkeypatch.setattr(memory, "available_memory", lambda device=None: (2 * small + 10 ** 7, "test"))
    plan = prepare_generate(tiny, _prompts(2), max_new_tokens=4, cache_size=64, check_free_memory=False)
    assert plan.memory["per-layer copy of the layer weights"] == small  # counted where it is made
    monkeypatch.setattr(memory, "available_memory", lambda device=None: (2 * small - 1, "test"))
    assert autoregressive.decode_layers(None, model=tiny) == "scan"
    assert "per-layer copy of the layer weights" not in prepare_generate(
        tiny, _prompts(2), max_new_tokens=4, cache_size=64, check_free_memory=False).memory
    monkeypatch.setattr(memory, "available_memory", lambda device=None: (2 * small, "test"))
    assert autoregressive.decode_layers(None, model=tiny) == "unrolled"


@pytest.mark.slow  # compiles the unrolled loop
def test_unrolled_loop_holds_one_copy_of_the_weights(tiny):
    """With unrolled layers the loop reads each layer's weights from slices that share the stacked weights' memory
    (`layer_views`: the same addresses, made once per model), its program holds no copy of them (XLA's temporary
    bytes drop by the layers' bytes against the program that slices them itself), and it decodes the same tokens."""
    from clover_jax.decoding.sampling import SamplingParams

    views = tiny.layers.layer_views()
    assert views is not None and len(views) == CFG.num_hidden_layers
    assert tiny.layers.layer_views()[0]["wq"] is views[0]["wq"]  # made once
    for name, stacked in tiny.layers.layer_params().items():
        step = stacked.nbytes // stacked.shape[0]
        for i, layer in enumerate(views):
            assert layer[name].unsafe_buffer_pointer() == stacked.unsafe_buffer_pointer() + i * step
            np.testing.assert_array_equal(np.asarray(layer[name]), np.asarray(stacked[i]))

    prompt = jnp.asarray(np.random.RandomState(3).randint(3, CFG.vocab_size, (2, 32)), jnp.int32)  # [B, T]
    lens = jnp.asarray([20, 13], jnp.int32)
    args = (nnx.state(tiny), prompt, lens, jnp.asarray([9, 9], jnp.int32), jnp.asarray([-1], jnp.int32),
            SamplingParams().arrays(), jax.random.key(0))
    fn = autoregressive._jitted(nnx.graphdef(tiny), 64, True, jnp.dtype(jnp.float32), None, "unrolled", "highest")
    slicing, reading = fn.lower(*args).compile(), fn.lower(*args, layer_weights=views).compile()
    saved = slicing.memory_analysis().temp_size_in_bytes - reading.memory_analysis().temp_size_in_bytes
    assert saved >= autoregressive.layer_weight_bytes(tiny)
    a, b = slicing(*args), reading(*args, layer_weights=views)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert int(b.steps) == 8


@pytest.mark.slow  # long prompts against a step-by-step reference
def test_long_prompt_greedy_matches_naive_argmax_loop(tiny):
    """A prompt over PREFILL_CHUNK tokens (prefilled in blocks) still decodes what full forwards would."""
    p = np.random.RandomState(5).randint(3, 64, autoregressive.PREFILL_CHUNK + 45).tolist()
    out = generate(tiny, [p], max_new_tokens=6).token_ids[0]
    assert out == _naive_greedy(tiny, p, len(out))


def test_stops_on_eos_and_max_new_tokens(tiny):
    res = generate(tiny, _prompts(6), max_new_tokens=9, cache_size=64)
    for toks in res.token_ids:
        assert 1 <= len(toks) <= 9
        assert 2 not in toks[:-1]  # EOS, if present, is the last token
        assert len(toks) == 9 or toks[-1] == 2


def test_max_new_tokens_is_traced_no_recompile(tiny):
    prompts = _prompts(2)
    generate(tiny, prompts, max_new_tokens=5, cache_size=64)
    fn = autoregressive.jitted_loop(tiny, 64, True)  # the cached jitted loop generate ran
    compiled = fn._cache_size()
    assert compiled >= 1
    r1 = generate(tiny, prompts, max_new_tokens=7, cache_size=64)
    r2 = generate(tiny, [p[:-1] for p in prompts], max_new_tokens=3, cache_size=64)
    assert fn._cache_size() == compiled, "a new max_new_tokens or a prompt in the same bucket recompiled"
    assert max(len(t) for t in r1.token_ids) <= 7 and max(len(t) for t in r2.token_ids) <= 3


def test_float32_decoding_asks_for_float32_products(tiny):
    """A float32 model decodes with float32 products on every backend (`products_precision`: by default JAX
    rounds float32 product inputs to TF32 on recent GPUs and to bfloat16 passes on TPUs); a bfloat16 model keeps
    the backend's default. Checked on the lowered loop, whatever the backend running the test."""
    from clover_jax.decoding.sampling import SamplingParams

    def lowered(model):
        fn = autoregressive.jitted_loop(model, 64, True)
        rows = autoregressive.row_inputs(np.full((1, 8), 5), np.full(1, 8), 4)
        return fn.lower(nnx.split(model)[1], *rows, jnp.asarray([2]), SamplingParams().arrays(),
                        jax.random.key(0)).as_text()

    assert autoregressive.products_precision(jnp.float32) == "highest"
    assert autoregressive.products_precision(jnp.bfloat16) is None
    f32 = lowered(tiny)
    assert f32.count("dot_general") > 0 and f32.count("HIGHEST") >= f32.count("dot_general")
    assert "HIGHEST" not in lowered(init_llama(CFG, seed=0, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16))
    with jax.default_matmul_precision("default"):  # a precision the caller chose is kept
        assert autoregressive.products_precision(jnp.float32) is None
        assert "HIGHEST" not in lowered(tiny)


@pytest.mark.slow  # sampling loops per seed
def test_sampling_is_reproducible_and_seed_dependent(tiny):
    prompts = _prompts(3)
    a = generate(tiny, prompts, max_new_tokens=8, cache_size=64, temperature=1.0, seed=1)
    b = generate(tiny, prompts, max_new_tokens=8, cache_size=64, temperature=1.0, seed=1)
    c = generate(tiny, prompts, max_new_tokens=8, cache_size=64, temperature=1.0, seed=2)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def _np_warp(logits, t, k, p):
    x = logits / t
    order = np.argsort(-x, kind="stable")
    keep = np.zeros_like(x, bool)
    if k > 0:
        keep[order[:k]] = True
    else:
        keep[:] = True
    xs = np.where(keep, x, -np.inf)
    probs = np.exp(xs - xs.max())
    probs /= probs.sum()
    srt = np.sort(probs)[::-1]
    cum = np.cumsum(srt) - srt
    n_keep = int((cum < p).sum())
    thresh = srt[n_keep - 1]
    probs = np.where(probs >= thresh, probs, 0)
    return probs / probs.sum()


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 10, 0.5), (0.5, 1, 1.0)])
def test_warp_matches_numpy(t, k, p):
    logits = np.random.RandomState(0).randn(4, 50).astype(np.float32) * 2
    got = np.asarray(warp_probs(logits, np.float32(t), np.int32(k), np.float32(p)))
    for row in range(4):
        np.testing.assert_allclose(got[row], _np_warp(logits[row].astype(np.float64), t, k, p), atol=1e-5)


def test_sample_with_uniform_inverse_cdf():
    probs = np.array([[0.0, 0.5, 0.0, 0.5]], np.float32)
    assert int(sample_with_uniform(np.array([0.0]), probs)[0]) == 1
    assert int(sample_with_uniform(np.array([0.49]), probs)[0]) == 1
    assert int(sample_with_uniform(np.array([0.51]), probs)[0]) == 3
    assert int(sample_with_uniform(np.array([0.999999]), probs)[0]) == 3
    # empirical check
    u = jax.random.uniform(jax.random.key(0), (20000,))
    p = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    s = np.asarray(sample_with_uniform(u, np.broadcast_to(p, (20000, 4))))
    np.testing.assert_allclose(np.bincount(s, minlength=4) / 20000, p, atol=0.015)
