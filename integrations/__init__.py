"""Adapters that plug triton_paged_ops into serving frameworks. Each imports its framework lazily."""
