"""A real Flower deployment of the fedpriv app: process commands, certificates, compose file.

    commands.py  the ``Deployment`` and the argv of every process (SuperLink, SuperNodes,
                 registration, submission), Flower's ``config.toml`` connection, health check
    certs.py     the CA, the SuperLink's TLS certificate and the SuperNodes' key pairs
    compose.py   the docker-compose file, rendered from the commands
    cli.py       ``fedpriv deploy ...``, installed into the ``fedpriv`` command line

The package builds commands, files and certificates; it never imports flwr (it runs Flower's
executables as processes) nor ``fedpriv.cli``. The names below are its public API.
"""

from fedpriv.deploy.certs import cert_hosts, chown_tree, generate_certs
from fedpriv.deploy.commands import (
    APP_OWNER,
    CA_CERT,
    CERTS_DIR,
    CONNECTION,
    CONTAINER_APP,
    CONTAINER_CERTS,
    CONTAINER_RESULTS,
    DEFAULT_HOSTS,
    DEPLOY_COMMAND,
    DOCKERFILE,
    IMAGE,
    NODE_KEY,
    NODE_PORT,
    NODE_PUB,
    RESULTS_DIR,
    RESULTS_FILE,
    SERVER_CERT,
    SERVER_KEY,
    SUPERLINK_PORT,
    Deployment,
    check_health,
    connection_toml,
    flwr_home,
    health_command,
    node_role,
    register_argv,
    register_command,
    run_config_string,
    setup_command,
    submit_argv,
    submit_command,
    superlink_command,
    supernode_command,
    write_connection,
)
from fedpriv.deploy.compose import compose_yaml

__all__ = [
    "APP_OWNER", "CA_CERT", "CERTS_DIR", "CONNECTION", "CONTAINER_APP", "CONTAINER_CERTS",
    "CONTAINER_RESULTS", "DEFAULT_HOSTS", "DEPLOY_COMMAND", "DOCKERFILE", "IMAGE", "NODE_KEY",
    "NODE_PORT", "NODE_PUB", "RESULTS_DIR", "RESULTS_FILE", "SERVER_CERT", "SERVER_KEY",
    "SUPERLINK_PORT", "Deployment", "cert_hosts", "check_health", "chown_tree", "compose_yaml",
    "connection_toml", "flwr_home", "generate_certs", "health_command", "node_role",
    "register_argv", "register_command", "run_config_string", "setup_command", "submit_argv",
    "submit_command", "superlink_command", "supernode_command", "write_connection",
]
