"""KVzip's reconstruction pass within the memory it saves: its blocks are attended and
forgotten without ever being appended, so no layer's buffer grows, and the pass peaks at the
prompt's cache plus one layer's prompt and block (the transient of one attention call) plus the
pass's scores. The target against the full cache (1.25x at 256 to 8k tokens on the embedded
model) is ``keepkv bench --reconstruction``'s; here, its accounting on a tiny model."""

import pytest
import torch

import keepkv
import keepkv.reconstruction
from keepkv.attention import enabled
from keepkv.models import CACHE_KWARG

from conftest import VOCAB, char_tokenizer, tiny_model


@pytest.mark.parametrize("length, chunk", [(40, 2048), (150, 2048), (150, 32)])
def test_the_pass_appends_nothing_and_peaks_at_the_prompt_plus_one_layer(length, chunk):
    model = tiny_model("llama-gqa", layers=6)
    tokenizer = char_tokenizer()
    ids = torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
    mask = torch.ones_like(ids)
    cache = keepkv.CompressedCache(model.config, f"kvzip+chunk={chunk}", 0.2)
    cache.expect_reconstruction()
    with enabled(model), torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{CACHE_KWARG: cache}, use_cache=True)
        prompt_bytes = cache.nbytes()
        buffers = [layer.nbytes() for layer in cache.layers]
        grew = []
        finish = cache.finish_reconstruction
        cache.finish_reconstruction = lambda: (grew.append([layer.nbytes() for layer in cache.layers]), finish())
        keepkv.reconstruction.run(model, tokenizer, cache, ids, mask, chat=False)
    assert grew == [buffers]  # every block forgotten, no buffer reallocated for it
    layer = cache.layers[0]
    _, kv_heads, _, head_dim = layer.keys.shape
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    words = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    # the longest instruction: REPEAT_NEXT, the carried tokens and the line that ends it
    instruction = words(keepkv.reconstruction.REPEAT_NEXT) + keepkv.reconstruction.CARRY + 1
    block = min(chunk, length) + instruction
    one_layer = (length + block) * kv_heads * (2 * head_dim * 4 + 4)  # keys, values (fp32) and bias
    scores = cache.num_layers * kv_heads * group * length * 4  # the pass's column maxima, fp32
    assert prompt_bytes < cache.prefill_peak_bytes <= prompt_bytes + one_layer + scores
    # What appending each block to every layer held (as the pass once did): far above.
    assert cache.prefill_peak_bytes < prompt_bytes + cache.num_layers * block * kv_heads * 2 * head_dim * 4
