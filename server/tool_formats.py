"""The tool-call formats `tool_choice: "auto"` serves, and which one a request gets:
--tool-call-parser names one, or `auto` reads it off the chat template (the marks
with which its family's template writes calls). A template that knows no tools gets
the hermes format, described to the model in a system message (server/tools.py).

Where xgrammar has a structural tag for a format, "auto" is also enforced by it: the
model may write text or calls, and a call once begun is a valid one. Mistral's
opening, [TOOL_CALLS], is a special token that a grammar over text cannot emit, so
that format is parsed only (as vLLM does), with special tokens kept in the text."""
from __future__ import annotations

import json
from dataclasses import dataclass

from kvserve.server.tool_parsers import (Call, CallStream, HermesStream, Llama3JsonStream,
                                         MistralStream, split_calls)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    stream: type[CallStream]
    marks: tuple[str, ...]  # a chat template holding one writes calls in this format
    wrap: tuple[str, str]  # what a call's {"name": ..., <arguments_key>: ...} sits in
    arguments_key: str
    xgrammar_model: str | None  # xgrammar's structural tag for it; None: parsed only
    keeps_special_tokens: bool = False  # its opening is one

    def split(self, text: str) -> tuple[str, list[Call]]:
        return split_calls(self.stream(), text)

    def write(self, name: str, arguments) -> str:
        """An earlier call as the model would have written it."""
        return self.wrap[0] + json.dumps({"name": name, self.arguments_key: arguments}) \
            + self.wrap[1]

    def how_to_call(self) -> str:
        return (self.wrap[0] + '{"name": <its name>, "' + self.arguments_key
                + '": <its arguments as JSON>}' + self.wrap[1])


FORMATS = {f.name: f for f in (
    ToolFormat("hermes", HermesStream, ("<tool_call>",), ("<tool_call>\n", "\n</tool_call>"),
               "arguments", "qwen_3"),
    ToolFormat("llama3_json", Llama3JsonStream, ("<|python_tag|>", "ipython"), ("", ""),
               "parameters", "llama"),
    ToolFormat("mistral", MistralStream, ("[TOOL_CALLS]",), ("[TOOL_CALLS][", "]"),
               "arguments", None, keeps_special_tokens=True),
)}
PARSER_CHOICES = ["auto", *FORMATS]


def knows_tools(template: str) -> bool:
    return "tools" in template or "tool_calls" in template


def tool_format(parser: str, template: str | None) -> ToolFormat | None:
    """The format of "auto" calls. parser: --tool-call-parser. None: the template
    writes calls in a format none of the parsers reads."""
    if parser != "auto":
        return FORMATS[parser]
    if template is None or not knows_tools(template):
        return FORMATS["hermes"]
    return next((f for f in FORMATS.values() if any(m in template for m in f.marks)), None)
