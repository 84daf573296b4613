"""The Responses store on its own: bounded (oldest first), expiring, deletable, and
each entry its owner's alone."""
from __future__ import annotations

from kvserve.server.responses.inputs import input_messages
from kvserve.server.responses.store import ResponseStore


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_oldest_go_first_past_the_bound():
    store = ResponseStore(2, ttl=100, clock=Clock())
    for rid in ("a", "b", "c"):
        store.put(rid, {"id": rid}, [], "me")
    assert store.get("a", "me") is None and store.get("b", "me").body == {"id": "b"}
    assert len(store) == 2


def test_entries_expire_after_the_ttl():
    clock = Clock()
    store = ResponseStore(10, ttl=5, clock=clock)
    store.put("a", {}, [], "me")
    clock.now = 3
    store.put("b", {}, [], "me")
    clock.now = 5
    assert store.get("a", "me") is None and store.get("b", "me") is not None
    clock.now = 8
    assert len(store) == 0


def test_delete_and_a_store_of_none():
    store = ResponseStore(10, ttl=5, clock=Clock())
    store.put("a", {}, [], "me")
    assert store.delete("a", "me") and not store.delete("a", "me")
    off = ResponseStore(0, ttl=5)
    off.put("a", {}, [], "me")
    assert off.get("a", "me") is None


def test_another_owner_finds_nothing_and_deletes_nothing():
    store = ResponseStore(10, ttl=5, clock=Clock())
    store.put("a", {"id": "a"}, [], "team-a")
    assert store.get("a", "team-b") is None and not store.delete("a", "team-b")
    assert store.get("a", "team-a").body == {"id": "a"}


def test_input_items_become_chat_messages():
    messages = input_messages([
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "think"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\":1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": "two"},
    ])
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "think",
         "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"id": "c2", "type": "function",
              "function": {"name": "g", "arguments": "{\"x\":1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]


def test_the_oldest_go_first_past_the_byte_budget():
    """--responses-store-bytes: what the entries hold together, as JSON; the oldest
    go until the new one fits, and one larger than the whole budget is not kept."""
    store = ResponseStore(100, ttl=100, max_bytes=300, clock=Clock())
    for rid in ("a", "b", "c"):
        store.put(rid, {"text": "x" * 100}, [], "me")
    assert store.get("a", "me") is None and store.get("c", "me") is not None
    assert store.bytes <= 300
    store.put("huge", {"text": "x" * 1000}, [], "me")
    assert store.get("huge", "me") is None and store.get("c", "me") is not None
    assert store.delete("c", "me") and store.delete("b", "me") and store.bytes == 0
