"""Drive a running kvserve with the clients people point at it: the openai SDK,
LiteLLM (`openai/` and `hosted_vllm/`) and LangChain's ChatOpenAI, whichever of them
the running Python has. None of them is a dependency of kvserve: install them in a
separate virtual environment, e.g.

    python -m venv /tmp/clients
    /tmp/clients/bin/pip install openai litellm mcp langchain-openai
    /tmp/clients/bin/python bench/client_compat.py http://127.0.0.1:8000

(LiteLLM imports `mcp` as soon as a request carries `tools`.)

Prints one line per check, `ok` or `FAIL` with what happened, and exits non-zero if
any failed. A refused feature (tools, structured outputs) counts as ok when the
client raises an error naming the field, rather than getting plain text back."""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
import traceback
from collections.abc import Callable

SEPARATORS = "line\u2028separator\u2029paragraph"
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def refused(call: Callable[[], object], field: str) -> str:
    """The call must raise, and the error must name the field."""
    try:
        result = call()
    except Exception as exc:  # each client raises its own error type
        if field not in str(exc):
            raise AssertionError(f"raised without naming {field}: {exc!r}") from exc
        return f"refused: {type(exc).__name__} names `{field}`"
    raise AssertionError(f"not refused, got {result!r:.200}")


def openai_checks(url: str, model: str) -> dict[str, Callable[[], str]]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    def echo_stream() -> str:
        text = "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt=SEPARATORS, max_tokens=4, echo=True, stream=True))
        assert text.startswith(SEPARATORS), repr(text)
        return f"echoed U+2028/U+2029 intact ({len(text)} chars)"

    def chat_stream() -> str:
        chunks = list(client.chat.completions.create(
            model=model, messages=QUESTION, max_completion_tokens=16, stream=True,
            stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens > 0
        return f"{text!r}, usage {chunks[-1].usage.completion_tokens} tokens"

    def parse() -> str:
        from pydantic import BaseModel

        class Answer(BaseModel):
            city: str

        return refused(lambda: client.chat.completions.parse(
            model=model, messages=QUESTION, response_format=Answer), "response_format")

    return {
        "models.list": lambda: str([m.id for m in client.models.list().data]),
        "models.retrieve": lambda: client.models.retrieve(model).id,
        "completions": lambda: repr(client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=8,
            temperature=0).choices[0].text),
        "completions stream, echo": echo_stream,
        "chat": lambda: repr(client.chat.completions.create(
            model=model, messages=QUESTION, max_completion_tokens=16,
            temperature=0).choices[0].message.content),
        "chat stream + usage": chat_stream,
        "chat with tools": lambda: refused(lambda: client.chat.completions.create(
            model=model, messages=QUESTION, tools=[TOOL]), "tools"),
        "chat.completions.parse": parse,
    }


def litellm_checks(url: str, model: str) -> dict[str, Callable[[], str]]:
    import litellm

    checks = {}
    for prefix in ("openai", "hosted_vllm"):
        name = f"{prefix}/{model}"
        common = dict(model=name, api_base=url + "/v1", api_key="unused", messages=QUESTION,
                      max_tokens=16, temperature=0)

        def plain(common=common) -> str:
            return repr(litellm.completion(**common).choices[0].message.content)

        def stream(common=common) -> str:
            return repr("".join(c.choices[0].delta.content or ""
                                for c in litellm.completion(**common, stream=True)))

        def tools(common=common) -> str:
            return refused(lambda: litellm.completion(**common, tools=[TOOL]), "tools")

        checks |= {f"{prefix}/ completion": plain, f"{prefix}/ stream": stream,
                   f"{prefix}/ tools": tools}
    return checks


def langchain_checks(url: str, model: str) -> dict[str, Callable[[], str]]:
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    llm = ChatOpenAI(base_url=url + "/v1", api_key="unused", model=model, temperature=0,
                     max_tokens=16, max_retries=0)

    class Answer(BaseModel):
        city: str

    return {
        "invoke": lambda: repr(llm.invoke("What is the capital of France?").content),
        "stream": lambda: repr("".join(c.content for c in llm.stream("Count to five."))),
        "batch": lambda: str([len(m.content) for m in llm.batch(["Hi", "Hello", "Hey"])]),
        "bind_tools": lambda: refused(
            lambda: llm.bind_tools([TOOL]).invoke("Weather in Paris?"), "tools"),
        "with_structured_output(function_calling)": lambda: refused(
            lambda: llm.with_structured_output(Answer, method="function_calling").invoke(
                "Capital of France?"), "tools"),
        "with_structured_output(json_schema)": lambda: refused(
            lambda: llm.with_structured_output(Answer, method="json_schema").invoke(
                "Capital of France?"), "response_format"),
    }


# client -> (module, distribution, checks)
CLIENTS = {"openai": ("openai", "openai", openai_checks),
           "litellm": ("litellm", "litellm", litellm_checks),
           "langchain": ("langchain_openai", "langchain-openai", langchain_checks)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url", help="e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = ap.parse_args()
    failed = 0
    for client, (module, distribution, checks) in CLIENTS.items():
        if importlib.util.find_spec(module) is None:
            print(f"{client}: not installed here, skipped")
            continue
        version = importlib.metadata.version(distribution)
        for name, check in checks(args.url, args.model).items():
            try:
                print(f"ok   {client} {version} {name}: {check()}")
            except Exception:  # report every check, then fail at the end
                failed += 1
                print(f"FAIL {client} {name}:\n{traceback.format_exc(limit=3)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
