"""The numbers `kvserve estimate` prints, as one flat dict."""
from __future__ import annotations

from kvserve.benchmarks.client.roofline import (Setup, decode_step_s, decode_weight_bytes,
                                                kv_budget_bytes, max_sequences, prefill_s)


def decode_numbers(s: Setup, batch: int, context: float, price: float, tag: str) -> dict:
    step, bound = decode_step_s(s, batch, context)
    tok_s = batch / step
    return {f"itl_ms{tag}": step * 1e3, f"decode_tok_s_per_seq{tag}": 1 / step,
            f"decode_tok_s{tag}": tok_s, f"decode_bound{tag}": bound,
            f"tokens_per_dollar{tag}": tok_s * 3600 / price,
            f"dollars_per_m_tokens{tag}": price / (tok_s * 3600) * 1e6}


def estimate(s: Setup, batch: int, prompt_len: int, output_len: int, price: float) -> dict:
    seq_len = prompt_len + output_len
    context = prompt_len + output_len / 2  # mean context over the decode
    ttft, prefill_bound = prefill_s(s, prompt_len)
    out = {"gpu": s.gpu.name, "params": s.shape.params(), "weight_gb": s.weight_bytes / 1e9,
           "decode_read_gb_at_batch_1": decode_weight_bytes(s) / 1e9,
           "kv_bytes_per_token": s.kv_per_token, "kv_budget_gb": kv_budget_bytes(s) / 1e9,
           "kv_capacity_tokens": max(0, int(kv_budget_bytes(s) // s.kv_per_token)),
           "max_sequences": max_sequences(s, seq_len), "batch": batch,
           "prompt_len": prompt_len, "output_len": output_len, "price_per_hour": price,
           "mbu": s.mbu, "mfu": s.mfu, "ttft_ms": ttft * 1e3, "prefill_bound": prefill_bound,
           "prefill_tok_s": prompt_len / ttft}
    out.update(decode_numbers(s, batch, context, price, ""))
    out["e2el_s"] = ttft + (output_len - 1) * out["itl_ms"] / 1e3
    if out["max_sequences"] > 0:
        out.update(decode_numbers(s, out["max_sequences"], context, price, "_at_capacity"))
    return out


def find_number(doc, key: str) -> float | None:
    """The first numeric `key` anywhere in a JSON document."""
    if isinstance(doc, dict):
        if isinstance(doc.get(key), (int, float)) and not isinstance(doc[key], bool):
            return float(doc[key])
        doc = list(doc.values())
    if isinstance(doc, list):
        for item in doc:
            found = find_number(item, key)
            if found is not None:
                return found
    return None


def efficiency(doc: dict, key: str) -> float:
    """A measured fraction of peak (`mbu`, `mfu`); percentages are accepted; 1 when
    absent."""
    value = find_number(doc, key)
    if value is None or value <= 0:
        return 1.0
    return value / 100 if value > 1.5 else value
