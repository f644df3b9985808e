"""The speaker-cache update of streaming Sortformer: NeMo's per-row `streaming_update_async` against
nemo_serve.diarization's array version (update.py), side by side in one run, CPU, one thread.

    python benchmarks/diar_update_bench.py --out benchmarks/results/diar_update_cpu.json

The state is the real model's size (512-dim pre-encoder embeddings, 4 speakers) at a model-card
latency setting, with rows at random fill levels (a quarter with a full cache); every row gets a
full chunk, so both versions do the same work (tests/test_diarization_update.py checks they agree on
these states). Timed: the update alone (not the model, not setting up the state: both update in place); the
median of --repeats runs per batch size.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import run_record, write_json  # noqa: E402
from nemo_serve.diarization.settings import MODEL_CARD_SETTINGS  # noqa: E402
from nemo_serve.diarization.slots import DiarState, SpeakerCacheSlots  # noqa: E402
from nemo_serve.diarization.update import ChunkRows, plan_update, update_slots  # noqa: E402


def sortformer_modules(setting: str, emb_dim: int = 512):
    from nemo.collections.asr.modules.sortformer_modules import SortformerModules

    s = MODEL_CARD_SETTINGS[setting]
    modules = SortformerModules(num_spks=4, fc_d_model=emb_dim, tf_d_model=192, spkcache_len=s.spkcache_len,
                                fifo_len=s.fifo_len, chunk_len=s.chunk_len, spkcache_update_period=s.spkcache_update_period,
                                chunk_left_context=s.chunk_left_context, chunk_right_context=s.chunk_right_context)  # fmt: skip
    return modules.eval()


def random_rows(modules, num_rows: int, gen: torch.Generator):
    """A NeMo async state at random fill levels, a full chunk and the model's preds over [cache|fifo|chunk]."""
    lc, rc, dim, k = modules.chunk_left_context, modules.chunk_right_context, modules.fc_d_model, modules.n_spk
    cache_len, fifo_len, width = modules.spkcache_len, modules.fifo_len, lc + modules.chunk_len + rc

    def randn(*shape):
        return torch.randn(shape, generator=gen)

    def probs(*shape):  # some speech, some silence, some overlap: tiny-sortformer's logit spread
        return torch.sigmoid(randn(*shape) * 3.0 - 2.5)

    def filled(lengths, frames, make, last):
        return make(num_rows, frames, last) * (torch.arange(frames).view(1, -1, 1) < lengths.view(-1, 1, 1))

    cache_lens = torch.randint(0, cache_len + 1, (num_rows,), generator=gen)
    cache_lens[: num_rows // 4] = cache_len
    fifo_lens = torch.randint(0, fifo_len + 1, (num_rows,), generator=gen)
    state = modules.init_streaming_state(batch_size=num_rows, async_streaming=True)
    state.spkcache, state.spkcache_preds = filled(cache_lens, cache_len, randn, dim), filled(cache_lens, cache_len, probs, k)
    state.fifo, state.fifo_lengths, state.spkcache_lengths = filled(fifo_lens, fifo_len, randn, dim), fifo_lens, cache_lens
    state.n_sil_frames = torch.randint(0, 5, (num_rows,), generator=gen)
    state.mean_sil_emb = randn(num_rows, dim) * (state.n_sil_frames > 0).unsqueeze(1)
    return state, randn(num_rows, width, dim), probs(num_rows, cache_len + fifo_len + width, k)


def load_pool(modules, nemo_state):
    """A slot table holding NeMo's state, one row per slot: (pool, slots)."""
    num_rows = nemo_state.spkcache.shape[0]
    pool = SpeakerCacheSlots.for_modules(modules, num_rows)
    for row in range(num_rows):
        pool.acquire(f"row{row}")
    s, slots = nemo_state, torch.arange(num_rows)
    pool.load(slots, DiarState(s.spkcache, s.spkcache_preds, s.spkcache_lengths, s.fifo, s.fifo_lengths,
                               s.mean_sil_emb, s.n_sil_frames))  # fmt: skip
    return pool, slots


def ours_in_place(modules, pool, slots, chunk, preds):
    """plan_update (the host's decisions) and update_slots on a loaded pool: (chunk preds [B, C, K],
    chunk lengths [B])."""
    n, lc, rc = chunk.shape[0], modules.chunk_left_context, modules.chunk_right_context
    rows = ChunkRows(chunk, torch.full((n,), chunk.shape[1]), torch.full((n,), lc), torch.full((n,), rc))
    t = pool.tables
    full = np.full(n, 1, np.int64)
    plan = plan_update(modules, pool, slots.numpy(), full * chunk.shape[1], full * lc, full * rc)
    chunk_preds = update_slots(modules, pool, slots, t.spkcache_lengths[slots], t.fifo_lengths[slots], rows, preds, plan)
    return chunk_preds, torch.from_numpy(plan.chunk_lens)


def ours(modules, nemo_state, chunk, preds):
    """(state after the step in NeMo's shapes, chunk preds, chunk lengths)."""
    pool, slots = load_pool(modules, nemo_state)
    chunk_preds, chunk_lengths = ours_in_place(modules, pool, slots, chunk, preds)
    return pool.gather(slots), chunk_preds, chunk_lengths


def nemo(modules, state, chunk, preds):
    """NeMo's update on a copy of the state (it updates in place): (state, chunk preds)."""
    state = copy.deepcopy(state)
    lengths = torch.full((chunk.shape[0],), chunk.shape[1])
    lc, rc = modules.chunk_left_context, modules.chunk_right_context
    return modules.streaming_update_async(state, chunk, lengths, preds, lc=lc, rc=rc)


def _median_ms(setup, fn, repeats: int) -> float:
    """Median time of fn(setup()) over repeats; setup (a fresh state: both updates work in place) untimed."""
    times = []
    for _ in range(repeats):
        args = setup()
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setting", default="low", choices=list(MODEL_CARD_SETTINGS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    modules = sortformer_modules(args.setting)
    record = {**run_record(), "setting": args.setting, "rows": []}
    with torch.no_grad():
        for num_rows in args.rows:
            state, chunk, preds = random_rows(modules, num_rows, torch.Generator().manual_seed(num_rows))
            lc, rc = modules.chunk_left_context, modules.chunk_right_context
            lengths = torch.full((num_rows,), chunk.shape[1])
            nemo_ms = _median_ms(lambda: (copy.deepcopy(state),), lambda s: modules.streaming_update_async(
                s, chunk, lengths, preds, lc=lc, rc=rc), args.repeats)
            ours_ms = _median_ms(lambda: load_pool(modules, state), lambda pool, slots: ours_in_place(
                modules, pool, slots, chunk, preds), args.repeats)
            row = {"rows": num_rows, "nemo_per_row_ms": round(nemo_ms, 3), "vectorised_ms": round(ours_ms, 3),
                   "speedup": round(nemo_ms / ours_ms, 2)}  # fmt: skip
            record["rows"].append(row)
            print(row, flush=True)
    if args.out:
        write_json(args.out, record)


if __name__ == "__main__":
    main()
