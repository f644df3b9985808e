"""Token ids -> what clients see of them: the one place the server turns ids into strings.

Text comes from the engine's result assembler (engine/results.Detokenizer, where pieces join with
their word-boundary marks turned into spaces); the wire formats' `tokens` lists are the raw
vocabulary pieces, so a client can rebuild the text or line tokens up with `token_ids`.
"""

from __future__ import annotations


def token_pieces(vocabulary: list[str], token_ids: list[int]) -> list[str]:
    """The vocabulary piece of each id; "" for an id past the vocabulary (a blank or special id)."""
    return [vocabulary[t] if t < len(vocabulary) else "" for t in token_ids]
