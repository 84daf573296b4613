"""Run `transformers serve` with vLLM's `ignore_eos` accepted on the completion routes.

transformers 5.23's server rejects any request field outside the OpenAI schema with
422 ("Unexpected fields in the request: {'ignore_eos'}"), and kvbench sends
`ignore_eos: true` on every request so that each one produces its full output.  This
launcher patches, in-process (no proxy hop), the two completion handlers:

- `ignore_eos` becomes an accepted field;
- when it is true the request's generation config gets `eos_token_id = -1`, which the
  continuous-batching manager reads as "no end-of-sequence token" (see
  transformers/generation/continuous_batching/requests.py), so generation stops only
  at `max_tokens`.

Everything else is `transformers serve` unchanged; arguments pass straight through:

    python bench/peers/transformers_serve.py --continuous-batching --dtype bfloat16 \
        --device cpu --host 127.0.0.1 --port 8100 /path/to/model_dir
"""

from __future__ import annotations

import sys


def patch() -> None:
    from transformers.cli.serving import chat_completion, completion

    for handler in (completion.CompletionHandler, chat_completion.ChatCompletionHandler):
        params = handler._valid_params_class
        params.__mutable_keys__ = frozenset(set(params.__mutable_keys__) | {"ignore_eos"})
        original = handler._build_generation_config

        def build(self, body, model_generation_config, use_cb=False, _orig=original):
            gen = _orig(self, body, model_generation_config, use_cb=use_cb)
            if body.get("ignore_eos"):
                gen.eos_token_id = -1
            return gen

        handler._build_generation_config = build


def main() -> int:
    patch()
    from transformers.cli.transformers import main as cli_main

    sys.argv = ["transformers", "serve", *sys.argv[1:]]
    return cli_main() or 0


if __name__ == "__main__":
    sys.exit(main())
