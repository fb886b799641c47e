"""Caches in front of the engines: the response cache (``gemel.cache.response``).

Off unless ``cache.response`` is configured; FAISS (semantic matching) and redis (the shared
backend) are imported only when the configuration asks for them.
"""
