"""The YAML config, parsed once at start-up into frozen, typed objects.

Every error names the YAML path and the reason (`routes.tavily.timeouts.per_try: expected a
duration like 10s, got "ten"`). Unknown keys are errors: a typo must not silently disable a
policy. Here is what is the document's: reading the file (`loading`), the server's own
sections (`sections`), routes and what they say of each other (`routes`), custom vendor
profiles (`profiles`), the whole document (`document`) and writing it back (`showing`). Each
policy's section is parsed by the policy's own module (policies/chain.py lists them).
"""

from policies.core.redisconfig import RedisConfig
from policies.core.route import HeaderRules, RouteConfig, Timeouts
from policies.core.settings import (
    ConfigError,
    ConfigErrors,
    parse_duration,
    parse_rate,
    parse_size,
)
from proxy.config.document import InvalidConfig, load_config, parse_config
from proxy.config.loading import (
    MAX_CONFIG_BYTES,
    MAX_DEPTH,
    MAX_VALUES,
    _Loader,
    interpolate,
    read_config_file,
    read_document,
)
from proxy.config.routes import RESERVED_PATHS
from proxy.config.sections import (
    ClientConfig,
    Config,
    LogConfig,
    McpServerConfig,
    SearchApiConfig,
    ServerConfig,
)
from proxy.config.showing import as_document, redacted, secret_values
from proxy.redact import REDACTED

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_DEPTH",
    "MAX_VALUES",
    "REDACTED",
    "RESERVED_PATHS",
    "ClientConfig",
    "Config",
    "ConfigError",
    "ConfigErrors",
    "HeaderRules",
    "InvalidConfig",
    "LogConfig",
    "McpServerConfig",
    "RedisConfig",
    "RouteConfig",
    "SearchApiConfig",
    "ServerConfig",
    "Timeouts",
    "_Loader",
    "as_document",
    "interpolate",
    "load_config",
    "parse_config",
    "parse_duration",
    "parse_rate",
    "parse_size",
    "read_config_file",
    "read_document",
    "redacted",
    "secret_values",
]
