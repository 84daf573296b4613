"""Graph packages that share a bf16 model's weights on kvserve's AVX512-BF16 GEMM
(engine/runner/package_constants.py; auto's choice where the CPU has it): the graphs
are not frozen, so each of the three packages is built with its constants outside
its library and bound at load to the model's own tensors: nothing is copied (each
graph's constants are the model's tensors, by address, every packed weight among
them); greedy output agrees with eager steps as far as bf16's rounding lets
compiled and eager steps agree (a tied embedding read from the head's pair panels);
a warm start binds them again with the same tokens; a package is refused when the
model has no tensor it names, or one of another dtype. The same in float32, token
for token, and frozen graphs keeping their constants: tests/engine/
test_graph_packages.py."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.runner.package_constants import BOUND, bind, model_tensors
from kvserve.engine.weights.cpu_packing import packing_wanted
from kvserve.scheduler.sampling_params import SamplingParams
from tests.support.reference import varied_prompts
from tests.support.tiny_models import make_tiny_model

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
KINDS = ("decode_one", "decode_many", "hidden")
CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not packing_wanted("auto", CPU, torch.bfloat16),
                                reason="kvserve's GEMM takes no bf16 layers on this CPU")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-tied-bf16"), dtype=torch.bfloat16,
                           tie_word_embeddings=True)


@pytest.fixture(scope="module")
def make(model_dir, tmp_path_factory):
    """make(**EngineConfig overrides) -> a bf16 engine; compiled ones from packages
    under one cache (built by a child process before the first step)."""
    from kvserve.engine.config.engine_config import EngineConfig
    from kvserve.engine.core.engine import Engine

    cache = tmp_path_factory.mktemp("kvserve-cache")

    def build(**overrides):
        cfg = dict(model=str(model_dir), dtype="bfloat16", num_kv_blocks=256,
                   max_num_batched_tokens=37, compile="wait", compile_cache="packages")
        cfg.update(overrides)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("KVSERVE_CACHE", str(cache))
            return Engine(EngineConfig(**cfg))

    build.cache = cache
    return build


@pytest.fixture(scope="module")
def first(make):
    engine = make()
    compiled = engine.runner.compiled
    assert compiled is not None and not compiled.frozen
    assert set(compiled.packages.graphs) == set(KINDS)
    return engine


def prompts(vocab: int) -> list[list[int]]:
    some = varied_prompts(vocab)[:6]
    return some + [some[0] + [5, 6, 7], some[1][:40] + [9] * 20]


def test_every_graph_reads_the_models_own_tensors(first, make):
    """Each package's constants are the model's tensors themselves (the same
    storage: every packed weight among them), its folder says they are bound, and
    its wrapper calls the products' C entry point (c_shims.py)."""
    model = first.runner.model
    owned = {t.data_ptr() for t in model_tensors(model).values()}
    panels = {m.packed.panels.data_ptr() for m in model.modules()
              if getattr(m, "packed", None) is not None}
    for kind, graph in first.runner.compiled.packages.graphs.items():
        constants = {t.data_ptr() for t in graph.runner.extract_constants_map(False).values()}
        assert constants and constants <= owned and panels <= constants, kind
        (folder,) = make.cache.glob(f"graphs/*/{kind}")
        assert (folder / BOUND).exists()
        # the products called by their C entry point, not through the dispatcher
        (wrapper,) = folder.glob("*.wrapper.cpp")
        assert "aoti_torch_cpu_bf16_linear(" in wrapper.read_text()


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_shared_packages_give_eager_tokens(batch, first, make):
    """Prompts chunked at 37 tokens (the hidden graph), decodes of one request and
    of several, prefix hits (the last two prompts share blocks), against eager steps
    on the same GEMM. In bf16 compiled steps round less often than eager ones
    (Inductor fuses, and the decode attention is another kernel) so the texts part at
    near-ties: each one's first tokens agree, and most of the rest."""
    eager = make(compile="off")
    some = prompts(first.model_config.vocab_size)
    same = total = 0
    for i in range(0, len(some), batch):
        got, want = (e.generate(some[i:i + batch], GREEDY) for e in (first, eager))
        for g, w in zip(got, want):
            assert g[:4] == w[:4]
            same, total = same + sum(a == b for a, b in zip(g, w)), total + len(w)
    assert same >= 0.6 * total
    assert first.scheduler.kv.num_free_blocks == first.scheduler.kv.num_blocks


def test_a_warm_start_binds_the_packages_again(first, make, caplog):
    some = prompts(first.model_config.vocab_size)
    want = first.generate(some, GREEDY)
    with caplog.at_level("INFO", logger="kvserve.compile"):
        second = make()
    assert "process of their own" not in caplog.text
    assert caplog.text.count("loaded the") == 3
    assert second.generate(some, GREEDY) == want
    ptr = second.runner.model.layers[0].mlp.down_proj.packed.panels.data_ptr()
    constants = second.runner.compiled.packages.graphs["hidden"].runner.extract_constants_map(False)
    assert ptr in {t.data_ptr() for t in constants.values()}


def test_a_package_naming_a_tensor_the_model_lacks_is_refused(first, make):
    (folder,) = make.cache.glob("graphs/*/hidden")
    (library,) = folder.glob("*.so")
    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(library), 1)
    tensors = model_tensors(first.runner.model)
    missing = dict(tensors)
    missing.pop("model.layers.0.mlp.down_proj.packed.panels")
    with pytest.raises(RuntimeError, match="down_proj.packed.panels is not a tensor"):
        bind(runner, folder, missing)
    wrong = {**tensors, "model.norm.weight": tensors["model.norm.weight"].float()}
    with pytest.raises(RuntimeError, match="model.norm.weight is not a tensor"):
        bind(runner, folder, wrong)
