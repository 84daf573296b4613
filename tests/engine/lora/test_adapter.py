"""PEFT adapters made on the fly (random A and B, ranks 8 and 16, different targets,
rsLoRA) read into our terms: B @ A with the folded scaling equals what PEFT's own
merge adds to each weight; every adapter we cannot serve is one clear error. And the
batched product against a per-token loop."""
from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.kernels.lora.batched import add_lora
from kvserve.engine.lora.adapter import LoRAAdapterError, load_adapter, projection_shapes

CASES = {
    "r8-attention": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "r16-all": dict(r=16, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj",
                                                        "o_proj", "gate_proj", "up_proj",
                                                        "down_proj"]),
    "r8-mlp-rslora": dict(r=8, lora_alpha=4, use_rslora=True,
                          target_modules=["gate_proj", "down_proj"]),
}


def make_adapter(base_dir, out_dir, seed=0, **lora):
    """Saves a random PEFT adapter; returns {(layer, module): merged - base weight}."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    peft_model.save_pretrained(str(out_dir))
    merged = peft_model.merge_and_unload().state_dict()
    deltas = {}
    for key, w in merged.items():
        parts = key.split(".")
        if "layers" in parts and not torch.equal(w, base[key]):
            deltas[(int(parts[parts.index("layers") + 1]), parts[-2])] = w - base[key]
    return deltas


@pytest.mark.parametrize("case", CASES)
def test_b_times_a_is_what_peft_merges(tiny_model_dir, tmp_path, case):
    base = tiny_model_dir("llama")
    deltas = make_adapter(base, tmp_path / case, **CASES[case])
    cfg = ModelConfig.from_pretrained(base)
    adapter = load_adapter(case, tmp_path / case, 16, cfg.num_layers, projection_shapes(cfg))
    assert adapter.rank == CASES[case]["r"]
    assert adapter.targets == set(CASES[case]["target_modules"])
    assert set(adapter.weights) == set(deltas)
    for key, (a, b) in adapter.weights.items():
        assert torch.allclose(b @ a, deltas[key], atol=1e-5), key


def test_an_adapter_we_cannot_serve_is_a_clear_error(tiny_model_dir, tmp_path):
    base = tiny_model_dir("llama")
    cfg = ModelConfig.from_pretrained(base)
    shapes = projection_shapes(cfg)
    make_adapter(base, tmp_path / "ok", r=16, lora_alpha=16, target_modules=["q_proj"])

    def load(path, max_rank=16, shapes=shapes):
        return load_adapter("a", path, max_rank, cfg.num_layers, shapes)

    with pytest.raises(LoRAAdapterError, match="above --max-lora-rank 8"):
        load(tmp_path / "ok", max_rank=8)
    with pytest.raises(LoRAAdapterError, match="not a PEFT adapter"):
        load(tmp_path)
    with pytest.raises(LoRAAdapterError, match="another base model"):
        load(tmp_path / "ok", shapes={**shapes, "q_proj": (7, 7)})
    for key, value, says in [("use_dora", True, "DoRA"), ("bias", "all", "biases"),
                             ("modules_to_save", ["lm_head"], "modules_to_save"),
                             ("peft_type", "IA3", "only LoRA"),
                             ("rank_pattern", {r".*\.q_proj": 8}, "per-module ranks"),
                             ("alpha_pattern", {"q_proj": 8}, "per-module alphas"),
                             ("rank_pattern", {"(": 8}, "per-module ranks")]:  # no regex
        config_file = tmp_path / "ok" / "adapter_config.json"
        original = config_file.read_text()
        config_file.write_text(json.dumps({**json.loads(original), key: value}))
        with pytest.raises(LoRAAdapterError, match=says):
            load(tmp_path / "ok")
        config_file.write_text(original)
    # a pattern for modules the adapter does not have (PEFT writes some) changes nothing
    config_file = tmp_path / "ok" / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()),
                                       "rank_pattern": {r".*\.gate_up_proj": 16}}))
    assert load(tmp_path / "ok").targets == {"q_proj"}
    make_adapter(base, tmp_path / "head", r=8, target_modules=["lm_head"])
    with pytest.raises(LoRAAdapterError, match="unexpected tensor"):
        load(tmp_path / "head")


def test_the_batched_product_equals_a_per_token_loop():
    torch.manual_seed(0)
    slots_n, r_max, d_in, d_out, t = 3, 16, 24, 40, 29
    a = torch.randn(slots_n, r_max, d_in)
    b = torch.randn(slots_n, r_max, d_out)  # B transposed, as the slots hold it
    a[1, 8:] = 0  # a rank-8 adapter in a rank-16 slot: zero-padded
    b[1, 8:] = 0
    x, y = torch.randn(t, d_in), torch.randn(t, d_out)
    slots = torch.randint(-1, slots_n, (t,))
    want = y.clone()
    for i in range(t):
        if slots[i] >= 0:
            want[i] += (a[slots[i]] @ x[i]) @ b[slots[i]]
    got = add_lora(y.clone(), x, a, b, slots)
    assert torch.allclose(got, want, atol=1e-4)
    untouched = slots < 0
    assert torch.equal(got[untouched], y[untouched])
    assert torch.equal(add_lora(y.clone(), x, a, b, torch.full((t,), -1)), y)


def test_slots_are_zero_padded_and_least_recently_used(tiny_model_dir, tmp_path):
    from kvserve.engine.lora.slots import LoRASlots, NoFreeSlotError

    base = tiny_model_dir("llama")
    cfg = ModelConfig.from_pretrained(base)
    shapes = projection_shapes(cfg)
    adapters = {}
    for i, case in enumerate(CASES):
        make_adapter(base, tmp_path / case, seed=i, **CASES[case])
        adapters[case] = load_adapter(case, tmp_path / case, 16, cfg.num_layers, shapes)
    slots = LoRASlots(2, 16, cfg.num_layers, shapes, torch.float32)
    first = slots.place("a", adapters["r8-attention"])
    second = slots.place("b", adapters["r16-all"])
    assert {first, second} == {0, 1}
    with pytest.raises(NoFreeSlotError):  # a step needing all three
        slots.place("c", adapters["r8-mlp-rslora"], keep={"a", "b"})
    slots.place("b", adapters["r16-all"])  # used again: "a" is now the older
    third = slots.place("c", adapters["r8-mlp-rslora"])
    assert third == first and slots.slot_of("a") is None and slots.slot_of("b") == second

    # the slot now holds exactly the new adapter: its own projections, zeros elsewhere
    x = torch.randn(5, cfg.hidden_size)
    for (layer, module), (a, b) in adapters["r8-mlp-rslora"].weights.items():
        if shapes[module][0] != cfg.hidden_size:
            continue
        y = add_lora(torch.zeros(5, shapes[module][1]), x, *slots.views(module, layer),
                     torch.full((5,), third))
        assert torch.allclose(y, x @ a.T @ b.T, atol=1e-5)
    assert not slots.views("q_proj", 0)[0][third].any()  # the old adapter's q_proj is gone
    # B sits on its block's diagonal: nothing of k's block reaches q's outputs
    q_out = shapes["q_proj"][1]
    assert not slots.expand[0][:, 2 * 16:, :q_out].any()
    slots.evict("b")
    assert slots.slot_of("b") is None
