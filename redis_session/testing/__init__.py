"""Test tooling shipped for users and third-party backends: a local Redis Cluster."""
