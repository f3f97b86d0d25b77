"""SGLang attention backend ``tpa`` (``--attention-backend tpa``), registered through SGLang's plugin entry point.

``register`` is the ``sglang.srt.plugins`` entry point; SGLang calls it at start-up. Nothing here imports SGLang
until then, so ``import triton_paged_ops`` never needs it.
"""

from __future__ import annotations

# The one place that names the supported SGLang release (also the pin of the `sglang` extra in pyproject.toml).
SUPPORTED_SGLANG = "0.5.23"
BACKEND_NAME = "tpa"


def register() -> None:
    """Add ``tpa`` to SGLang's ``--attention-backend`` choices and its backend registry."""
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        DETERMINISTIC_ATTENTION_BACKEND_CHOICES,
        RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND,
        add_attention_backend_choices,
        add_deterministic_attention_backend_choices,
        add_radix_supported_deterministic_attention_backend_choices,
    )
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    # --enable-deterministic-inference runs the ops in batch-invariant mode, whose rows are also bitwise the same
    # between a whole prefill and a prefill resumed after a radix-cache hit: the radix cache can stay on.
    if BACKEND_NAME not in DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
        add_deterministic_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND:
        add_radix_supported_deterministic_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in ATTENTION_BACKENDS:

        @register_attention_backend(BACKEND_NAME)
        def _create(runner):
            from .backend import TpaAttnBackend

            return TpaAttnBackend(runner)
