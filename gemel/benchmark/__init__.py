"""Client-side benchmarks (``gemel bench serve``)."""
