"""The gateway: tenants, API keys, signed requests, rate limits, admission.

* ``tenants`` - the tenants file (YAML): tenants, hashed API keys, Ed25519 public keys, limits.
* ``signing`` - ``X-LLM-Signature`` verification and the replay (nonce) cache.
* ``ratelimit`` - the ``RateLimiter`` protocol and its in-process token buckets.
* ``counters`` - ``GatewayCounters``: every rejection, per tenant and reason (for metrics).
* ``gateway`` - ``Gateway``: authentication and admission, independent of HTTP, so the REST
  middleware and (later) the gRPC surface share it.
* ``middleware`` - the ASGI middleware that puts the gateway in front of the REST surfaces.
* ``cli`` - ``gemel keys``.
"""
