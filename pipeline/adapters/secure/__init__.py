"""A secure deployment's identities (``dsh-pipeline certs``, deploy/compose/secure.yml,
deploy/kubernetes): a throwaway CA and certificates (:mod:`.tls`), one principal and password
per role with the broker's and clients' settings (:mod:`.security`), the least-privilege ACL
plan (:mod:`.acls`), the registry's basic-auth settings (:mod:`.registry_auth`) and the
secure compose stack's secret folders (:mod:`.compose`). The development package's local stack
runs the same setup (``dsh-pipeline broker --secure``).
"""
