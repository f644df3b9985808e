"""The one private piece of NeMo's Sortformer this package calls, behind a version check.

`SortformerModules._compress_spkcache` (NeMo 3.0) is already batched over rows; calling it, rather
than a copy, keeps the speaker cache's top-k choice NeMo's by construction.
"""

from __future__ import annotations

from ..versions import require

require("nemo_toolkit", "3.0", "3.1", uses="SortformerModules._compress_spkcache (streaming diarization)")


def compress_spkcache(modules, embs, preds, mean_sil_emb):
    """(speaker cache [B, spkcache_len, D], its preds [B, spkcache_len, K]) kept from embs/preds [B, N, ...]."""
    spkcache, spkcache_preds, _ = modules._compress_spkcache(
        emb_seq=embs, preds=preds, mean_sil_emb=mean_sil_emb, permute_spk=False
    )
    return spkcache, spkcache_preds
