"""A test-only vLLM worker extension: what keepkv keeps of each request, read from a worker's blocks,
and the rankings its compressions kept them by.

tests/test_vllm.py gives engines ``worker_extension_cls="vllm_ranks.KeptEntries"``; vLLM mixes the
class into every worker, in-process or a spawned rank (which finds this module on the path its
parent had), and ``LLM.collective_rpc("keepkv_kept", args=(requests,))`` returns each rank's answer.
"""

import torch

from helpers import slot_positions
from keepkv.methods.base import ComposedMethod

# While a worker records (KeptEntries.keepkv_record): (layer, newest position of a store row) ->
# ([H_kv, S] positions, [H_kv, S] priorities) of the last plan made for that row. Requests of
# distinct prompt lengths, a few steps each, never share a newest position.
_RECORDED: dict | None = None
_PLAN = ComposedMethod.plan


def _recording_plan(self, layer):
    made = _PLAN(self, layer)
    if _RECORDED is not None:
        for row in range(layer.positions.shape[0]):
            newest = int(layer.positions[row].max())
            _RECORDED[layer.layer_idx, newest] = (layer.positions[row].clone(), made.priority[row].float().clone())
    return made


class KeptEntries:
    """Mixed into a vLLM worker: reads keepkv's position words of the slots each request holds, and
    records the rankings of its compressions."""

    def keepkv_record(self, on: bool) -> dict | None:
        """Start recording every compression's ranking in this worker (``on``), or stop and return
        what was recorded ({(layer, newest position): (positions, priorities)})."""
        global _RECORDED
        recorded, _RECORDED = _RECORDED, ({} if on else None)
        ComposedMethod.plan = _recording_plan if on else _PLAN
        return None if on else recorded

    def keepkv_kept(self, requests: dict[str, tuple[int, int]]) -> dict:
        """{"rank": this worker's tensor-parallel rank, "kv_heads": its KV heads, "kept": {request
        id: [L] int64 tensors [H_kv, S_l], the positions layer l holds in its slots 0..S_l-1, per KV
        head of this rank}} for ``requests`` {request id: (prompt tokens, tokens processed)} (the
        sizes keepkv derives from token counts: ``PagedCompression.stored``); the requests this
        worker no longer holds are left out."""
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.model_executor.models.utils import extract_layer_index

        from keepkv.vllm.backend import _WORKER

        runner = self.model_runner
        paged = _WORKER["paged"]
        head_dim = runner.model_config.get_head_size()
        caches = {}
        for name, module in runner.compilation_config.static_forward_context.items():
            if isinstance(getattr(module, "kv_cache", None), torch.Tensor) and module.kv_cache.numel():
                caches[extract_layer_index(name)] = module.kv_cache
        # vLLM's KV cache group of each layer (layers grouped by budget hold blocks of their own).
        group_of = {extract_layer_index(name): index for index, group in enumerate(runner.kv_cache_config.kv_cache_groups)
                    for name in group.layer_names}
        kept, kv_heads = {}, None
        for request_id, (prompt, processed) in requests.items():
            state = runner.requests.get(request_id)
            if state is None:
                continue
            kept[request_id] = [slot_positions(paged, caches[layer], torch.tensor(state.block_ids[group_of[layer]]),
                                               paged.stored(prompt, processed, layer), head_dim)
                                for layer in sorted(caches)]
            kv_heads = caches[min(caches)].shape[1]
        return {"rank": get_tensor_model_parallel_rank(), "kv_heads": kv_heads, "kept": kept}
