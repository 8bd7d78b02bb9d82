"""No compression: the reference every method is measured against."""

from dataclasses import dataclass

from .base import Method, register


@register
@dataclass
class Full(Method):
    """Keep every entry. Output equals Hugging Face's own generation token for token."""

    name = "full"
    paper = "-"

    def allocate(self, layers, kv_heads, row_budget, prompt_lengths, scores=None):
        return None
