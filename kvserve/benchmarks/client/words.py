"""Common English words for synthetic prompts. Short, frequent words are one token
each (with their leading space) in the usual BPE vocabularies, so a prompt of N words
is close to N tokens without the client needing the model's tokenizer."""
from __future__ import annotations

import random

WORDS = tuple("""
the of and to in is was for on are as with his they at be this from have or by one
had not but what all were when we there can an your which their said if do will each
about how up out them then she many some so these would other into has more her two
like him see time could no make than first been its who now people my made over did
down only way find use may water long little very after words called just where most
know get through back much go good new write our me man too any day same right look
think also around another came come work three word must because does part even place
well such here take why things help put years different away again off went old
number great tell men say small every found still between name should home big give
air line set own under read last never us left end along while might next sound below
saw something thought both few those always looked show large often together asked
house world going want school important until form food keep children feet land side
without boy once animals life enough took sometimes four head above kind began almost
live page got earth need far hand high year mother light parts country father let
night following picture being study second eyes soon times story boys since white
days ever paper hard near sentence better best across during today others sure means
knew try told young miles sun ways thing whole hear example heard several change
answer room sea against top turned learn point city play toward five using himself
usually money seen car morning given river open seemed warm sleep cold clear
""".split())


def random_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(WORDS, k=n))


def random_token_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    # Low ids are real tokens in every vocabulary; special tokens usually sit at the top.
    return [rng.randrange(vocab_size) for _ in range(n)]
