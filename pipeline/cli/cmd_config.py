"""``dsh-pipeline config``: every setting with its environment variable, default and value.

The output is the generated configuration reference: ``--markdown`` prints the table that
``docs/configuration.md`` and ``deploy/README.md`` embed (tests keep both in step with
:class:`Settings`), ``--env``
prints an env file of the current values. Secret values are always masked.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Final, TextIO

from pipeline.cli.common import EXIT_USAGE
from pipeline.core.errors import ConfigError
from pipeline.settings import Secret, Settings

# Why each setting exists, for the reference table. A setting missing here is shown as
# undocumented (and the guide test tells whoever added it to write a line here).
DESCRIPTIONS: Final[dict[str, str]] = {
    "bootstrap_servers": "Kafka bootstrap servers, comma-separated `host:port`.",
    "topic_prefix": "Prefix of every topic name (`<prefix>session-events`, `<prefix>inbox`, ...).",
    "partitions": "Partitions of the project's topics when `topics ensure` creates them; "
                  "inbox and session events always get the same count (co-partitioned).",
    "replication_factor": "Replication factor of topics created by the project.",
    "security_protocol": "Kafka security protocol: `PLAINTEXT`, `SSL`, `SASL_PLAINTEXT`, "
                         "`SASL_SSL`.",
    "sasl_mechanism": "SASL mechanism when `DSH_SECURITY_PROTOCOL` is `SASL_PLAINTEXT` or "
                      "`SASL_SSL`: `PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512`; empty means "
                      "`PLAIN`. Not used by the other protocols.",
    "sasl_username": "SASL user name.",
    "sasl_password": "SASL password (secret).",
    "ssl_cafile": "Path of the CA bundle that signs the brokers' certificates.",
    "registry_url": "Base URL of the Confluent-compatible schema registry API "
                    "(Apicurio: `.../apis/ccompat/v7`).",
    "registry_username": "Schema registry user name (HTTP basic auth); empty: none.",
    "registry_password": "Schema registry password (secret).",
    "provider": "Model provider of the driver: `scripted` (demos, tests), `deepseek`, or "
                "`openai` (any OpenAI-compatible endpoint at `provider_base_url`).",
    "model": "Model name sent to the provider.",
    "provider_base_url": "Base URL of the model provider's API.",
    "deepseek_api_key": "DeepSeek API key (secret); `DEEPSEEK_API_KEY` is read too.",
    "group_id_prefix": "Prefix of the consumer group ids (`<prefix>driver`, ...).",
    "dashboard_host": "Interface the dashboard binds to (`0.0.0.0` in a container).",
    "dashboard_port": "HTTP port of the dashboard (`/`, `/health`, `/metrics`).",
    "dashboard_token": "Bearer token the dashboard requires (secret); empty: no auth.",
    "dashboard_tls_cert": "PEM certificate (chain) file: the dashboard serves HTTPS only.",
    "dashboard_tls_key": "PEM private key file of DSH_DASHBOARD_TLS_CERT.",
    "dashboard_processors_url": "Base URL of the processors workers' HTTP views (e.g. "
                                "`http://processors:6066`): a session page starts from the "
                                "owning worker's tables, reading no derived record; empty: "
                                "from the derived-messages topic.",
    "processors_web_port": "HTTP port of a processors worker (`/health`, `/metrics`, tables).",
    "driver_metrics_port": "HTTP port of the driver's `/health` and `/metrics`.",
    "state_dir": "Directory of the processors' local table state (RocksDB); keep it on a "
                 "persistent volume.",
    "otlp_endpoint": "Base URL of the OTLP/HTTP receiver `dsh-pipeline otel` posts to "
                     "(`<endpoint>/v1/traces`, protobuf).",
    "otlp_headers": "Headers of every OTLP request, `name=value,...` with percent-encoded "
                    "values, e.g. `Authorization=Basic%20...` (secret).",
    "otel_metrics_port": "HTTP port of `dsh-pipeline otel`'s `/health` and `/metrics`.",
    "max_record_bytes": "The one Kafka record-size limit: topics' `max.message.bytes`, "
                        "producers' `max_request_size`, consumers' fetch sizes; larger "
                        "content is spilled or refused (docs/large-content.md).",
    "spill_inline_bytes": "A plain-text tool result above this many UTF-8 bytes is spilled to "
                          "`<prefix>spill`; the model sees a head/tail preview of this size.",
    "mcp_config": "The driver's MCP servers: a JSON file in the `mcpServers` format "
                  "(`driver --mcp-config` wins); empty: none (docs/mcp.md).",
    "tool_timeout": "Seconds an MCP tool call may take before it ends as a `TOOL_TIMEOUT` "
                    "error result (the server is told to cancel it).",
    "driver_idle_evict": "Seconds a driven session stays in the driver's memory with no turn "
                         "running and no command; then it is evicted and loaded again from "
                         "its checkpoint by its next command (docs/driver-state.md).",
    "provider_limits": "Provider rate limits shared by the driver fleet: a JSON object, or "
                       "the path of a JSON file, e.g. `{\"deepseek/deepseek-chat\": "
                       "{\"requests_per_minute\": 500, \"tokens_per_minute\": 1000000}, "
                       "\"tenants\": {\"acme\": {\"weight\": 2}}}` "
                       "(docs/provider-limits.md); empty: no limits.",
    "prices": "The price table of the cost ledger (`dsh-pipeline processors`): a JSON object, "
              "or the path of a JSON file, e.g. `{\"deepseek/deepseek-chat\": [{\"from\": "
              "\"2025-09-05\", \"input\": \"0.28\", \"cached_input\": \"0.028\", "
              "\"output\": \"0.42\"}]}`, prices per million tokens (docs/costs.md); "
              "empty: every call unpriced.",
    "providers": "Named provider endpoints: a JSON object, or the path of a JSON file, "
                 "mapping a provider name to `{\"kind\": \"deepseek\" | "
                 "\"openai-compatible\" | \"scripted\", \"baseURL\", \"apiKeyEnv\"}`; "
                 "`apiKeyEnv` names the environment variable holding the key, never the key "
                 "(docs/providers.md); empty: the built-in providers only.",
    "provider_fallbacks": "Each model's fallbacks, tried in order while it fails or is over "
                          "budget: a JSON object, or the path of a JSON file, e.g. "
                          "`{\"deepseek/deepseek-chat\": [\"backup/gpt-4o-mini\"], "
                          "\"policy\": {\"max_wait_s\": 10, \"cool_off_s\": 30}}` "
                          "(docs/providers.md); empty: no fallback.",
}
UNDOCUMENTED: Final = "(undocumented: add a line to DESCRIPTIONS in pipeline/cli/cmd_config.py)"
REFERENCE_HEADER: Final = "| Variable | Default | Description |"


@dataclass(frozen=True, slots=True)
class SettingRow:
    """One setting as the reference shows it: texts only, secrets already masked."""

    name: str
    env_var: str
    default: str
    current: str
    secret: bool
    description: str


def setting_rows(settings: Settings) -> list[SettingRow]:
    """Every field of :class:`Settings` in declaration order, with default and current value."""
    defaults = Settings()
    rows = []
    for f in fields(Settings):
        default = getattr(defaults, f.name)
        rows.append(SettingRow(
            name=f.name,
            env_var=f"DSH_{f.name.upper()}",
            default=_as_text(default),
            current=_as_text(getattr(settings, f.name)),
            secret=isinstance(default, Secret),
            description=DESCRIPTIONS.get(f.name, UNDOCUMENTED),
        ))
    return rows


def _as_text(value: Any) -> str:
    # str(Secret) is the mask (or "" when unset): the secret's value never reaches the text.
    return str(value)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|") if text else ""


def render_markdown(rows: list[SettingRow]) -> str:
    """The reference table of ``deploy/README.md``: defaults only, so it does not depend on
    the environment it is generated in."""
    lines = [REFERENCE_HEADER, "|---|---|---|"]
    for row in rows:
        default = f"`{_md_cell(row.default)}`" if row.default else "(empty)"
        lines.append(f"| `{row.env_var}` | {default} | {_md_cell(row.description)} |")
    return "\n".join(lines) + "\n"


def render_env(rows: list[SettingRow]) -> str:
    """An env file of the current values. A set secret is written commented out and masked:
    the file is safe to share, and whoever uses it fills the secret in."""
    lines = []
    for row in rows:
        if row.secret and row.current:
            lines.append(f"# {row.env_var}={row.current}  (secret: set the real value)")
        else:
            lines.append(f"{row.env_var}={row.current}")
    return "\n".join(lines) + "\n"


def render_table(rows: list[SettingRow]) -> str:
    """A plain aligned table: variable, default, current value."""
    header = ("VARIABLE", "DEFAULT", "CURRENT")
    cells = [header] + [(r.env_var, r.default, r.current) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    out = ["  ".join(c[i].ljust(widths[i]) for i in range(len(header))).rstrip() for c in cells]
    return "\n".join(out) + "\n"


def settings_and_errors(env: Mapping[str, str] | None = None
                        ) -> tuple[Settings, list[str]]:
    """The environment's settings, leaving out (at their defaults) the variables that do not
    parse, and what is wrong with each of those: the table still shows every other value."""
    source = dict(os.environ if env is None else env)
    errors: list[str] = []
    for name in sorted(k for k in source if k.startswith("DSH_")):
        try:
            Settings.from_env({name: source[name]})
        except ConfigError as exc:
            errors.append(str(exc))
            del source[name]
    return Settings.from_env(source), errors


def run(args: argparse.Namespace, settings: Settings, out: TextIO | None = None) -> int:
    """Exit 2 (a usage error) when a variable does not parse, after the table."""
    settings, errors = settings_and_errors()
    rows = setting_rows(settings)
    if args.markdown:
        text = render_markdown(rows)
    elif args.env:
        text = render_env(rows)
    else:
        text = render_table(rows)
    (out or sys.stdout).write(text)
    for error in errors:
        print(f"dsh-pipeline config: error: {error} (its default is shown)", file=sys.stderr)
    return EXIT_USAGE if errors else 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "config",
        help="print every setting: env variable, default, current value (secrets masked)",
        description="Print every setting with its DSH_* variable, default and current "
                    "value. Secret values are masked.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--markdown", action="store_true",
                      help="the reference table of deploy/README.md (defaults, descriptions)")
    mode.add_argument("--env", action="store_true",
                      help="an env file of the current values (set secrets masked)")
    parser.set_defaults(func=run, uses_settings=False)
