"""The schema registry's security settings: HTTPS only with basic auth against embedded users
(no OIDC server), Apicurio's roles enforced. The secure compose stack (:mod:`.compose`), the
Kubernetes registry (deploy/kubernetes/registry.yaml) and the development package's local
registry all use these (tests keep them equal).
"""

from __future__ import annotations

from typing import Final

# Quarkus reads an embedded user's password and roles from these (plus _<USER>).
EMBEDDED_USERS_ENV: Final = "QUARKUS_SECURITY_USERS_EMBEDDED_USERS"
EMBEDDED_ROLES_ENV: Final = "QUARKUS_SECURITY_USERS_EMBEDDED_ROLES"


def secure_registry_properties(cert_file: str, key_file: str, port: int) -> dict[str, str]:
    """The Quarkus properties of the registry on HTTPS only with basic auth (no OIDC server),
    Apicurio's roles enforced. The secure local stack runs these; the Kubernetes registry
    (deploy/kubernetes/registry.yaml) sets the same as environment variables (a test keeps
    them equal)."""
    return {
        "quarkus.http.ssl-port": str(port),
        "quarkus.http.insecure-requests": "disabled",
        "quarkus.http.ssl.certificate.files": cert_file,
        "quarkus.http.ssl.certificate.key-files": key_file,
        "quarkus.oidc.tenant-enabled": "false",
        "quarkus.http.auth.basic": "true",
        "apicurio.auth.role-based-authorization": "true",
        "quarkus.security.users.embedded.enabled": "true",
        "quarkus.security.users.embedded.plain-text": "true",
    }


def registry_role(principal: str) -> str:
    """Apicurio's role of a principal: the admin registers schemas, every other reads."""
    return "sr-admin" if principal == "admin" else "sr-readonly"


def quarkus_env_name(prop: str) -> str:
    """The environment variable Quarkus reads a property from (non-alphanumerics to ``_``,
    upper case)."""
    return "".join(c if c.isalnum() else "_" for c in prop).upper()
