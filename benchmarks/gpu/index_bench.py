"""Phase 3 of the GPU profile (profile_step.py): GB/s of index_select / index_copy_ on the pool's
K/V cache laid out as the engine's (all layers in one tensor: 64-bit index math past 2^31
elements) and per layer (32-bit), against a plain copy_ of the same bytes."""

from __future__ import annotations

from benchmarks.gpu.record import free_gpu
from benchmarks.gpu.timing import Timer, median_ms


def index_bench(args, model, timer: Timer) -> dict:
    """GB/s of the cache gather/scatter kernels on the pool's K/V layout, whole pool and per layer."""
    import torch

    from benchmarks.architecture import set_mode
    from nemo_serve.engine.encoder import make_encoder
    from nemo_serve.engine.slots import SlotPool

    set_mode(model)
    pool = SlotPool(model, args.index_slots, make_encoder(model).channel_shape, max_rows=1)
    kv = pool.cache_last_channel  # [L, S+1, *channel]
    n = min(args.index_rows, args.index_slots)
    rows = torch.randperm(args.index_slots, generator=torch.Generator().manual_seed(0))[:n].to(kv.device)
    out = torch.empty((kv.shape[0], n, *kv.shape[2:]), dtype=kv.dtype, device=kv.device)
    moved = out.numel() * out.element_size()

    def rate(fn) -> float | None:
        fn()  # warm-up
        marks = []
        for _ in range(args.index_reps):
            a = timer.mark()
            fn()
            marks.append((a, timer.mark()))
        ms = median_ms(timer.done(marks))
        return round(moved / (ms / 1000) / 1e9, 2) if ms else None

    layers = [kv[i] for i in range(kv.shape[0])]
    res = {"slots": args.index_slots, "rows": n, "pool_elements": kv.numel(), "over_2_31": kv.numel() >= 2**31,
           "bytes_moved": moved, "dtype": str(kv.dtype).replace("torch.", ""),
           "index_select_gbs": rate(lambda: torch.index_select(kv, 1, rows, out=out)),
           "index_copy_gbs": rate(lambda: kv.index_copy_(1, rows, out)),
           "per_layer_index_select_gbs": rate(lambda: [torch.index_select(x, 0, rows, out=o) for x, o in zip(layers, out)]),
           "per_layer_index_copy_gbs": rate(lambda: [x.index_copy_(0, rows, o) for x, o in zip(layers, out)]),
           "copy_gbs": rate(lambda: out.copy_(kv[:, :n]))}  # fmt: skip
    pool = kv = out = layers = None  # freed before the next phase (the lambdas above are done)
    free_gpu()
    return res
