"""``gemel check``: audit a configuration, tenants file, Kubernetes manifests and a running server.

* ``rules`` - the typed ``Rule`` / ``Finding`` records and the one registry (``all_rules()``).
* ``config_rules`` - gateway, network, engine and observability rules over gemel.yaml and the tenants file.
* ``k8s`` - loading manifests and the deployment rules over them.
* ``live`` - probing a running server (``--url``) and the rules over what it answered.
* ``audit`` - gathering the inputs and running every rule into a ``Report``.
* ``report`` - text, JSON and Markdown output, and the exit code.
* ``html`` - the self-contained HTML report (rule table and risk heatmap).
* ``cli`` - the ``gemel check`` arguments.

Nothing here imports torch: the check runs where the server's dependencies are not installed
(a CI job linting manifests).
"""
