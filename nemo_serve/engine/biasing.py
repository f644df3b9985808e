"""Per-stream phrase boosting: each stream's phrase list as a boosting tree in NeMo's multi-model.

NeMo 3.0's label-looping decoder boosts per row: a `GPUBiasingMultiModel` holds many boosting
trees (each with its own weight), a `multi_biasing_ids` tensor [B] names each row's tree (-1:
none) and a per-row tree state rides in the decoder state (`fusion_states_list`). At every label
iteration the row's tree adds its scores to the non-blank logits; a row with id -1 gets exactly
0.0 added and its argmax is unchanged, so an unboosted stream decodes as without biasing.

A tree is built once per (phrases, boost): streams with the same list share one tree and one
multi-model id, counted by reference; the tree leaves the multi-model when its last stream ends.
Built trees stay in a small LRU (`max_cached_trees`) so a list that comes back is not rebuilt.
Only the loop thread calls `BiasingRegistry` (it changes tensors the decoder reads).

The tree is NeMo's own: `GPUBoostingTreeModel.from_config(BoostingTreeModelConfig(...))` with
the fields `boosting_tree_config` fills, the same config the oracle (oracle.py) gives NeMo's
decoder as `greedy.boosting_tree`, with `boost` as `boosting_tree_alpha`.
"""

from __future__ import annotations

import collections

import torch
from nemo.collections.asr.parts.context_biasing.biasing_multi_model import GPUBiasingMultiModel
from nemo.collections.asr.parts.context_biasing.boosting_graph_batched import (
    BoostingTreeModelConfig,
    GPUBoostingTreeModel,
)

from ..nemo_private import computer_copy
from .phrases import NO_BIASING, PhraseRequest  # noqa: F401 - re-exported


def boosting_tree_config(phrases: tuple[str, ...]) -> BoostingTreeModelConfig:
    """NeMo's boosting tree for a phrase list, at NeMo's RNN-T defaults (context_score 1,
    depth_scaling 2, no unk score)."""
    return BoostingTreeModelConfig(key_phrases_list=list(phrases))


class BiasingRegistry:
    """Owns the decoder's multi-model, the built trees and which (phrases, boost) holds which id."""

    def __init__(self, tokenizer, vocab_size: int, device: torch.device, max_cached_trees: int = 256) -> None:
        self.tokenizer = tokenizer
        self.unk_id = getattr(tokenizer, "unk_id", None)
        self.device = device
        self.multi_model = GPUBiasingMultiModel(vocab_size=vocab_size, reallocation_callback_fn=self._reallocated)
        self.multi_model.to(device)
        self.on_reallocate: list = []  # decoders holding graphs over the multi-model's buffers
        self._trees: collections.OrderedDict[PhraseRequest, GPUBoostingTreeModel] = collections.OrderedDict()
        self._max_cached = max_cached_trees
        self._ids: dict[PhraseRequest, list[int]] = {}  # request -> [multi-model id, streams using it]
        self._requests: dict[int, PhraseRequest] = {}  # multi-model id -> request
        self.trees_built = 0

    @property
    def num_active(self) -> int:
        return len(self._ids)

    def _reallocated(self) -> None:
        for fn in self.on_reallocate:
            fn()

    def tokenize(self, phrase: str) -> list[int]:
        ids = self.tokenizer.text_to_ids(phrase)
        if not ids or (self.unk_id is not None and self.unk_id in ids):
            raise ValueError(f"phrase {phrase!r} does not tokenize without <unk>")
        return ids

    def tree(self, request: PhraseRequest) -> GPUBoostingTreeModel:
        """The request's tree, built on first use and kept in the LRU."""
        tree = self._trees.get(request)
        if tree is not None:
            self._trees.move_to_end(request)
            return tree
        for phrase in request.phrases:
            self.tokenize(phrase)
        tree = GPUBoostingTreeModel.from_config(boosting_tree_config(request.phrases), tokenizer=self.tokenizer)
        tree.to(self.device)
        self.trees_built += 1
        self._trees[request] = tree
        while len(self._trees) > self._max_cached:
            self._trees.popitem(last=False)
        return tree

    def acquire(self, request: PhraseRequest) -> tuple[int, int]:
        """(multi-model id, the tree's initial state) for a new stream; NO_BIASING without phrases."""
        if not request:
            return NO_BIASING, 0
        entry = self._ids.get(request)
        tree = self.tree(request)
        if entry is None:
            model_id = self.multi_model.add_model(tree, alpha=request.boost)
            entry = self._ids[request] = [model_id, 0]
            self._requests[model_id] = request
        entry[1] += 1
        return entry[0], int(tree.bos_state)

    def release(self, model_id: int) -> None:
        """A stream holding `model_id` ended; the tree leaves the multi-model with its last stream."""
        if model_id == NO_BIASING:
            return
        request = self._requests[model_id]
        entry = self._ids[request]
        entry[1] -= 1
        if entry[1] == 0:
            del self._ids[request], self._requests[model_id]
            self.multi_model.remove_model(model_id)


def biasing_computer(base, multi_model: GPUBiasingMultiModel):
    """A shallow copy of NeMo's label-looping computer with per-stream biasing on: what
    `enable_per_stream_biasing=True` builds, sharing `multi_model`. NeMo runs the multi-model inside
    its CUDA graphs only with Triton (`compatible_with_cuda_graphs`); without it, eager."""
    c = computer_copy(base)
    c.biasing_multi_model = multi_model
    if not multi_model.compatible_with_cuda_graphs():
        c.cuda_graphs_mode = None
    return c
