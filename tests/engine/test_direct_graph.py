"""engine/runner/direct_graph.py: a compiled graph called past Dynamo's frame gives what
the compiled function gives, and refuses (None) any call whose step inputs are not
as the graph was compiled for, as Dynamo's guards would."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.engine.runner.direct_graph import DirectCall, GraphRecorder, model_tensors


class Toy(nn.Module):
    """A weight, a plain tensor attribute (as a KV cache is) and a tuple of them (as
    an fp8 cache's scales are), and a size of a step input used as a number."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8), requires_grad=False)
        self.cache = torch.randn(4, 8)
        self.scales = (torch.tensor(2.0), torch.tensor(3.0))

    def forward(self, x, table, lengths):
        width = table.shape[1]
        return ((x @ self.weight) * width + self.cache[0] * self.scales[0] + lengths.sum()
                + table.sum())


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    toy = Toy()
    recorder = GraphRecorder({})
    fn = torch.compile(toy, backend=recorder, dynamic=False)
    x = torch.randn(1, 8)
    table, lengths = torch.zeros(1, 3, dtype=torch.int32), torch.ones(3)
    torch._dynamo.mark_dynamic(table, 1)
    torch._dynamo.mark_dynamic(lengths, 0)
    fn(x, table, lengths)
    assert recorder.last is not None
    return toy, fn, recorder.last, (x, table, lengths)


def test_model_tensors_are_parameters_buffers_and_tensor_attributes(compiled):
    toy = compiled[0]
    found = model_tensors(toy)
    assert {id(toy.weight), id(toy.cache), *map(id, toy.scales)} <= found
    assert id(torch.zeros(1)) not in found


def test_direct_call_gives_the_compiled_graph_s_outputs(compiled):
    toy, fn, graph, step_args = compiled
    direct = DirectCall.build(graph, step_args, model_tensors(toy))
    assert direct is not None
    for width in (2, 5, 9):
        x = torch.randn(1, 8)
        table, lengths = torch.zeros(1, width, dtype=torch.int32), torch.rand(width)
        (out,) = direct(x, table, lengths)
        assert torch.equal(out, fn(x, table, lengths))  # the same graph: exact
        torch.testing.assert_close(out, toy(x, table, lengths))


def test_direct_call_refuses_inputs_the_graph_was_not_compiled_for(compiled):
    toy, _, graph, step_args = compiled
    direct = DirectCall.build(graph, step_args, model_tensors(toy))
    x, table, lengths = torch.randn(1, 8), torch.zeros(1, 4, dtype=torch.int32), torch.ones(4)
    assert direct(x, table, lengths) is not None
    assert direct(x.double(), table, lengths) is None  # dtype
    assert direct(torch.randn(2, 8), table, lengths) is None  # a fixed size
    assert direct(x[0], table, lengths) is None  # rank
    assert direct(torch.randn(1, 16)[:, ::2], table, lengths) is None  # strides
    assert direct(x, table[:, :1], lengths) is None  # a size of 1: Dynamo specialises


def test_no_direct_call_for_an_input_of_unknown_origin(compiled):
    toy, _, graph, (x, table, lengths) = compiled
    assert DirectCall.build(graph, (x, table), model_tensors(toy)) is None
    assert DirectCall.build(graph, (x, table, lengths), set()) is None
