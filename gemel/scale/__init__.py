"""Serving one model on several engine replicas through Ray Serve (``gemel serve --replicas N``).

``router`` (which replica takes a prompt) and ``context`` import nothing heavy; ``pool`` and
``replica`` import Ray, and only when replicas are configured. ``app`` builds the replicas'
application for something else to deploy (KubeRay's RayService), for front ends to attach to.
"""
